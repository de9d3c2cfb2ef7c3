"""The GPU suite's CPU mode (``benchmarks/gpu_suite.py --device cpu --tiny``), so that the
suite a GPU machine runs cannot rot: every measurement it makes on a GPU runs here on a
tiny tied model, vLLM sync included, and lands in its JSON and markdown table."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_cpu_tiny_mode_measures_every_column_and_writes_json_and_table(transfer_vllm_server,
                                                                       tmp_path):
    """The tied tiny Qwen2 is the tests' model: its syncs go into the session's transfer
    server (instead of one the suite would start), which gets its weights back."""
    from vllm_fixture import restore_weights

    try:
        done = subprocess.run(
            [sys.executable, "benchmarks/gpu_suite.py", "--device", "cpu", "--tiny",
             "--models", "tiny-qwen2-tied", "--vllm-url", transfer_vllm_server.url,
             "--out", str(tmp_path)],
            cwd=REPO, capture_output=True, text=True, timeout=900)
    finally:
        restore_weights(transfer_vllm_server)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "suite.json").read_text())
    (row,) = report["shapes"]
    assert row["model"] == "tiny-qwen2-tied" and row["full"]["model"]["tied_embeddings"]
    for mode in ("full", "lora"):
        step = row[mode]["loops"]["train_step"]
        assert step["ms_per_step_median"] > 0 and row[mode]["workload"]["batch_size"] == 4
    assert row["lora"]["lora_rank"] == 16
    # a CPU has no out-of-memory to stop at: every length up to the limit fits
    assert row["longest"]["longest_sequence"]["longest_fitting"] == 2048
    sync = row["sync"]
    assert sync["backend"] == "shm" and len(sync["transfer_seconds"]) == 3
    assert max(sync["check_mean_abs_diff"]) < 1e-3  # vLLM served every synced version
    table = (tmp_path / "suite.md").read_text()
    assert "| tiny-qwen2-tied |" in table and "(shm)" in table and "error" not in table


def test_the_full_shapes_refuse_a_cpu(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--device", "cpu",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "--device cpu --tiny" in done.stderr


def test_the_trainer_repeat_check_runs_and_deterministic_kernels_repeat_bit_for_bit(tmp_path):
    """``benchmarks/trainer_repeat.py`` (the GPU check of ``train.deterministic``) on the CPU
    tiny model: with deterministic kernels (no op of the trainer lacks one: one would
    raise) the trainer's steps run, move the weights and repeat bit for bit."""
    out = tmp_path / "repeat.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/trainer_repeat.py", "--batch-size", "4", "--seq-len", "128",
         "--steps", "2", "--modes", "deterministic", "--json", str(out)], cwd=REPO,
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    r = json.loads(out.read_text())["deterministic"]
    assert r["largest_update"] > 0 and r["elements"] > 0 and r["ms_per_step"] > 0
    assert r["identical"] and r["warnings"] == []
