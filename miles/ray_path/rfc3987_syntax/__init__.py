# Seen only by the processes of a Ray that miles starts on this machine (miles.cluster.start_ray puts this folder
# first on their PYTHONPATH). Ray imports jsonschema in every one of its processes, and jsonschema imports the
# optional rfc3987_syntax (installed with Jupyter) when it can; that module compiles a grammar at import, in every
# process (`miles bench startup` measures ray.init with and without this folder). Failing here makes jsonschema
# skip its "iri" format check, which Ray does not use, as it does where the package is not installed.
raise ImportError("rfc3987_syntax is hidden from the Ray processes miles starts (miles/ray_path)")
