"""experiments/gpu_check.py runs anywhere, skips what needs CUDA, and judges drift."""

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).parents[1] / "experiments" / "gpu_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_passes_and_says_what_it_skipped(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert _script().main(["--json", str(out), "--size-mb", "1"]) == 0
    result = json.loads(out.read_text())
    assert result["failures"] == []
    if not torch.cuda.is_available():
        assert result["cluster"]["skipped"].startswith("no CUDA device")
        assert result["bulk"] == {"cuda": False}


def test_a_drifting_gradient_fails_the_check() -> None:
    failures = _script()._cluster_failures(
        {"nccl": {"grad_max_abs_diff": 3e-6, "weights_max_abs_diff": 0.0}}
    )
    assert failures == ["nccl: max |diff| 3.00e-06 > 1e-06"]


def test_the_cohort_section_times_three_arms_and_stays_within_tolerance() -> None:
    """The same section the GPU runs, on the CPU with 40 clients: the cohort agrees with the
    per-client trainer within STEP_TOLERANCE per step; without CUDA the GPU run skips."""
    module = _script()
    result = module.cohort_check("cpu", clients=40, repeats=1)
    assert set(result["round_s"]) == {"plain", "per_client", "cohort"}
    assert 0.0 <= result["tolerance_used"] <= 1.0
    assert result["drift"] <= 1e-4
    if not torch.cuda.is_available():
        assert module.cohort_check("cuda")["skipped"].startswith("no CUDA device")
