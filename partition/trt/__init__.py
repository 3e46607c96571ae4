"""TensorRT engines for the slices, written to the Python API that TensorRT 8.5/8.6 and 10.3 share.
Modules: api.py (loading tensorrt, its version, the calls spelled differently per version),
profiles.py (prefill/decode optimisation profiles), precision.py (precision plans, fp32 layers),
api_builder.py (the API builder), trtexec.py (the trtexec builder), cache.py (the engine cache),
engines.py (per-slice build orchestration, engines.json), runner.py (`TrtRunner`), slice_engines.py
(a build's engines: the runners for `load_chain`, the engines for `orin-agent build --engine trt`). No
engine has been built or run with these modules on any machine of this project (docs/TENSORRT.md)."""
