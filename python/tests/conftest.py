"""Fixtures for the adjoint_sharding tests (docs/python.md, "Tests").

Environment: ASH_CLI, the `ash` tool to compare with (ctest sets it);
ASH_SOURCE_DIR, the repository (for perf_tests/torch_baseline.py, the oracle).
"""
import os
import pathlib
import subprocess

import numpy as np
import pytest

SOURCE_DIR = pathlib.Path(os.environ.get("ASH_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))


@pytest.fixture(scope="session")
def ash_cli():
    cli = os.environ.get("ASH_CLI")
    if not cli or not os.access(cli, os.X_OK):
        pytest.skip("ASH_CLI does not name the ash tool")
    return cli


def run_cli(cli, *args):
    r = subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ash {' '.join(map(str, args))}: {r.stderr.strip()}")
    return r.stdout


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, ash_cli):
    """A double checkpoint V=17, P=8, N=4, K=3 (parameters moved off their
    special values) and a .u32 token file of 400 ids."""
    import adjoint_sharding as ash
    d = tmp_path_factory.mktemp("tiny")
    ck = ash.init({"model": {"vocab": 17, "width": 8, "state": 4, "layers": 3, "seed": 5},
                   "grad": {"chunk": 4}}, "double")
    rng = np.random.default_rng(3)
    for k, v in ck.items():
        ck[k] = v + (1.0 if k == "embedding" else 0.3) * rng.uniform(-1, 1, v.shape)
    path = d / "m.h5"
    ash.save(path, ck)
    ids = rng.integers(0, 17, 400).astype("<u4")
    tokens = d / "t.u32"
    ids.tofile(tokens)
    return path, tokens, ids
