# Seen only by the processes of a Ray that miles starts on this machine (miles.cluster.start_ray puts this folder
# first on their PYTHONPATH). Ray imports jsonschema in every one of its processes, and jsonschema imports the
# optional rfc3987_syntax (installed with Jupyter) when it can; that module compiles a grammar at import, 1.8 s of
# CPU per process, ~6 s of a local Ray's start on 2 cores. Failing here makes jsonschema skip its "iri" format
# check, which Ray does not use, as it does where the package is not installed.
raise ImportError("rfc3987_syntax is hidden from the Ray processes miles starts (miles/ray_path)")
