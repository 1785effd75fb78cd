"""Started by every Python interpreter that has this folder on PYTHONPATH: the tests put it
there (tests/fake_cuda.py, `FakeCuda.environment`) so that the searcher processes a run spawns
see the same fake GPUs as the test that started the run."""
import os

if os.environ.get("TBA_FAKE_CUDA"):
    import fake_cuda
    fake_cuda.FakeCuda.install_from_environment()
