"""Episode ids are names, sandboxes live directly under the harness root and only what the harness created is ever
removed; the run token reaches servers by file or environment (review 2026-12-04, A1 and S18's rule for secrets)."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from miles.agents.harness import EpisodeSpec, Harness
from miles.agents.run_token import TOKEN_ENV, server_token
from miles.agents.sandbox import Sandboxes, check_episode_id
from miles.secret_file import read_secret_file, write_secret_file


def test_an_episode_id_is_a_bounded_name_never_a_path():
    for good in ("s0-g1-0-0abcd", "a", "A.b_c-9", "x" * 128, "..a", "a.."):
        assert check_episode_id(good) == good
    for bad in ("/tmp/v", "../v", "a/b", "a\\b", ".", "..", "", "x" * 129, "a b", "é", "a\x00", 5, None, ["a"]):
        with pytest.raises(ValueError, match="must be a name of 1-128 characters"):
            check_episode_id(bad)


def test_a_sandbox_is_made_directly_under_the_root_and_only_what_was_made_is_removed(tmp_path):
    root, victim = tmp_path / "root", tmp_path / "victim"
    root.mkdir()
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    (root / "link").symlink_to(victim)
    (root / "theirs").mkdir()
    boxes = Sandboxes(root)
    with pytest.raises(ValueError, match="not directly under the harness root"):
        boxes.create("link", {"a.py": "x"})
    with pytest.raises(ValueError, match="already exists and this harness did not create it; it is left alone"):
        boxes.create("theirs", {"a.py": "x"})
    box = boxes.create("mine", {"a.py": "x = 1\n"})
    assert box == (root / "mine").resolve() and (box / "a.py").read_text() == "x = 1\n"
    boxes.remove(root.resolve() / "theirs")
    boxes.remove((root / "link").resolve())
    boxes.remove(box)
    assert (root / "theirs").is_dir() and (victim / "keep.txt").exists() and not box.exists()
    assert boxes.names() == ["link", "theirs"]


def test_an_episode_whose_id_names_an_existing_directory_errors_and_leaves_it(tmp_path):
    """The review's rmtree ran on the error path of exactly this case (mkdir failed on an existing directory)."""
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "precious.txt").write_text("keep")

    async def run():
        harness = Harness(tmp_path, instances={"a": "http://127.0.0.1:1"}, token="t")
        harness.start([EpisodeSpec(episode_id="keep", instance_id="a")])
        results, _ = await harness.results(0, wait_s=10.0)
        harness.close()
        return results

    [r] = asyncio.run(run())
    assert r["status"] == "error" and "it is left alone" in r["error"]
    assert (tmp_path / "keep" / "precious.txt").read_text() == "keep" and tmp_path.is_dir()


def test_an_episode_spec_refuses_a_session_url_and_names_the_instance_flag():
    with pytest.raises(ValueError, match=r"session_url is not accepted.*--instance ID=URL"):
        EpisodeSpec.parse({"episode_id": "e", "instance_id": "a", "session_url": "http://evil"})
    with pytest.raises(ValueError, match="must be a name"):
        EpisodeSpec.parse({"episode_id": "/etc", "instance_id": "a"})
    with pytest.raises(ValueError, match="is a JSON object"):
        EpisodeSpec.parse(["e"])


def test_closing_a_harness_removes_its_own_root_but_never_a_given_one_or_its_other_files(tmp_path):
    given = tmp_path / "given"
    given.mkdir()
    (given / "other.txt").write_text("x")
    Harness(given, instances={}, token="t").close()
    assert (given / "other.txt").exists()
    fresh = tmp_path / "fresh"
    Harness(fresh, instances={}, token="t").close()
    assert not fresh.exists()


def test_a_server_reads_its_token_from_a_file_or_the_environment_and_hides_it_from_its_children(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert server_token("p") == "from-env" and TOKEN_ENV not in os.environ
    path = write_secret_file(tmp_path / "tok", "from-file")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert server_token("p", str(path)) == "from-file" and TOKEN_ENV not in os.environ
    fresh = server_token("p")
    printed = capsys.readouterr().err
    token_file = printed.split("with the token in ")[1].split(" ")[0]
    assert read_secret_file(token_file, "--token-file") == fresh and len(fresh) >= 40
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    with pytest.raises(FileExistsError):
        write_secret_file(path, "again")
    with pytest.raises(ValueError, match="--token-file .* cannot be read"):
        server_token("p", str(tmp_path / "missing"))
