"""``examples/train_lm.py``: the transformer against numpy, a tiny run of the
script, and the same training on simulated agents, 2 MPI processes and a
device mesh."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from test_examples_sim import _example

from jaxfog.testing import launch_environment, run_command
from paths import EXAMPLES

TINY = ["--size", "tiny", "--agents", "2", "--no-progress", "--quiet"]
# Two methods with different exchanges: neighbour averaging every step, and
# DiLoCo's pseudo-gradients compressed (top-k) and allgathered once a round of 4 steps.
TWO_METHODS = [*TINY, "--methods", "atc,diloco-compressed", "--graphs", "one-peer",
               "--rounds", "4", "--steps", "8", "--eval-every", "4"]


def _report(out: Path, stem: str = "lm_2agents") -> dict:
    return json.loads((out / f"{stem}.json").read_text())


# -- the model against an independent numpy forward pass ------------------------------------


def _layer_norm(x, scale, bias, epsilon):
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + epsilon) * scale + bias


def _gelu(x):  # the tanh form (jax.nn.gelu's default)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _numpy_loss(p: dict, windows: np.ndarray, heads: int, epsilon: float) -> float:
    """Mean next-byte cross-entropy (nats) of a one-block pre-LN transformer."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    length = inputs.shape[1]
    x = p["embed"][inputs] + p["position"][:length]
    h = _layer_norm(x, p["ln1_scale"], p["ln1_bias"], epsilon)
    qkv = h @ p["qkv_kernel"] + p["qkv_bias"]
    width = x.shape[-1]
    dim = width // heads
    out = np.zeros_like(x)
    causal = np.tril(np.ones((length, length), bool))
    for head in range(heads):
        cols = slice(head * dim, (head + 1) * dim)
        q, k, v = (qkv[..., part * width:(part + 1) * width][..., cols] for part in range(3))
        scores = np.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(dim), -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out[..., cols] = weights @ v
    x = x + out @ p["out_kernel"] + p["out_bias"]
    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"], epsilon)
    x = x + _gelu(h @ p["in_kernel"] + p["in_bias"]) @ p["mlp_kernel"] + p["mlp_bias"]
    logits = _layer_norm(x, p["lnf_scale"], p["lnf_bias"], epsilon) @ p["embed"].T
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-np.take_along_axis(log_probs, targets[..., None], -1).mean())


def test_one_block_matches_a_numpy_forward_pass():
    from flax import nnx

    lm = _example("train_lm")
    model = lm.Transformer(width=16, depth=1, heads=4, context=12, rngs=nnx.Rngs(3))
    # Every parameter random (LayerNorm scales and biases too), then read back.
    graphdef, params = nnx.split(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    params = jax.tree.unflatten(treedef, [
        (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for v in leaves])
    model = nnx.merge(graphdef, params)
    block = model.blocks[0]

    def value(variable):
        return np.asarray(variable[...], np.float64)

    p = {"embed": value(model.embed.embedding), "position": value(model.position),
         "ln1_scale": value(block.attention_norm.scale),
         "ln1_bias": value(block.attention_norm.bias),
         "qkv_kernel": value(block.qkv.kernel), "qkv_bias": value(block.qkv.bias),
         "out_kernel": value(block.attention_out.kernel),
         "out_bias": value(block.attention_out.bias),
         "ln2_scale": value(block.mlp_norm.scale), "ln2_bias": value(block.mlp_norm.bias),
         "in_kernel": value(block.mlp_in.kernel), "in_bias": value(block.mlp_in.bias),
         "mlp_kernel": value(block.mlp_out.kernel), "mlp_bias": value(block.mlp_out.bias),
         "lnf_scale": value(model.norm.scale), "lnf_bias": value(model.norm.bias)}
    windows = rng.integers(0, 256, (3, 11)).astype(np.uint8)  # 10 inputs, under the context
    expected = _numpy_loss(p, windows.astype(np.int64), 4, block.attention_norm.epsilon)
    got = float(lm.loss_nats(model, windows))
    assert expected > 1.0
    np.testing.assert_allclose(got, expected, rtol=2e-5)
    # Causal: the first byte's logits do not depend on the later bytes.
    changed = windows.copy()
    changed[:, 2:] = 0
    np.testing.assert_array_equal(np.asarray(model(windows[:, :1].astype(np.int32))),
                                  np.asarray(model(changed[:, :1].astype(np.int32))))
    first = np.asarray(model(windows[:, :-1].astype(np.int32)))[:, 0]
    np.testing.assert_allclose(np.asarray(model(changed[:, :-1].astype(np.int32)))[:, 0],
                               first, rtol=1e-6, atol=1e-6)


# -- the script -------------------------------------------------------------------------------


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        _example("train_lm").main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--methods", "--size", "--iid", "--mesh", "--straggler", "--rounds"):
        assert option in text, option


def test_tiny_run_learns_and_reports(tmp_path, capsys):
    """Allreduce and asynchronous push-sum on 4 simulated agents, 24 steps:
    the loss falls towards the unigram model's, the report is written, bytes
    and simulated time follow the methods' exchanges and speeds."""
    report = _example("train_lm").main([
        *TINY, "--agents", "4", "--methods", "allreduce,push-sum", "--steps", "24",
        "--eval-every", "12", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert "4 simulated agents" in text and "| unigram model" in text
    for suffix in ("md", "json", "png"):
        assert (tmp_path / f"lm_4agents.{suffix}").stat().st_size > 500, suffix
    assert report["python"] == sys.version.split()[0]
    results = report["results"]
    assert list(results) == ["allreduce", "push-sum async, straggler 4x"]
    unigram = report["unigram_bpb"]
    assert 4.0 < unigram < 5.5
    allreduce = results["allreduce"]
    assert [r["step"] for r in allreduce] == [0, 12, 24]
    assert allreduce[0]["val_bpb"] == pytest.approx(8.0, abs=0.1)  # uniform over 256 bytes
    assert allreduce[-1]["val_bpb"] < allreduce[1]["val_bpb"] < allreduce[0]["val_bpb"] - 2
    assert allreduce[-1]["val_bpb"] < unigram + 0.3
    assert allreduce[-1]["train_bpb"] < allreduce[1]["train_bpb"]
    # A ring allreduce sends 2 (n - 1) / n of the parameters' bytes a step.
    assert allreduce[-1]["sent_bytes"] == 24 * 1.5 * 4 * report["parameters"]
    # Simulated time: every synchronous step waits for the 4x straggler, and
    # the allreduce carries 1.5 copies of the model at 0.25 each; push-sum's
    # fast agents take 24 steps in 24 units, the straggler 6.
    assert allreduce[-1]["simulated_time"] == pytest.approx(24 * (4 + 0.25 * 1.5))
    push = results["push-sum async, straggler 4x"]
    assert push[-1]["simulated_time"] == 24 and push[-1]["iterations"] == [6, 24, 24, 24]
    assert push[-1]["val_bpb"] < push[0]["val_bpb"] - 2


def _table_row(text: str, label: str) -> dict[str, str]:
    """The summary table's row of ``label``, by column name."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| method |"))
    row = next(line for line in lines if line.startswith(f"| {label} |"))
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    return dict(zip(cells(header), cells(row), strict=True))


def test_bfloat16_learns_and_reports_mfu(tmp_path, capsys):
    """``--dtype bfloat16`` on 2 agents: the loss falls as in float32 (not
    bit for bit: the compute is bfloat16), and the summary reports model
    TFLOP/s and MFU against the peak given."""
    lm = _example("train_lm")
    common = [*TINY, "--methods", "allreduce", "--steps", "24", "--eval-every", "12"]
    f32 = lm.main([*common, "--out", str(tmp_path / "f32")])
    capsys.readouterr()
    report = lm.main([*common, "--dtype", "bfloat16", "--peak-tflops", "0.5",
                      "--out", str(tmp_path / "bf16")])
    text = capsys.readouterr().out
    assert report["dtype"] == "bfloat16" and report["peak_tflops"] == 0.5
    rows, rows32 = report["results"]["allreduce"], f32["results"]["allreduce"]
    bpb = [r["val_bpb"] for r in rows]
    assert all(math.isfinite(b) for b in bpb) and bpb[2] < bpb[1] < bpb[0] - 2
    assert bpb[-1] != rows32[-1]["val_bpb"]
    assert abs(bpb[-1] - rows32[-1]["val_bpb"]) < 0.3
    # 6 per matmul parameter (all but the learned positions) + 12 L d T.
    size = lm.SIZES["tiny"]
    matmul = report["parameters"] - size.context * size.width
    assert report["flops_per_token"] == 6 * matmul + 12 * size.depth * size.width * size.context
    row = _table_row(text, "allreduce")
    tokens = float(row["tokens/s"].replace(",", ""))
    tflops = float(row["model TFLOP/s"])
    assert tokens > 0 and tflops == pytest.approx(  # printed to 3 significant digits
        tokens * report["flops_per_token"] / 1e12, rel=5e-3)
    assert float(row["MFU"].rstrip("%")) == pytest.approx(100 * tflops / 0.5, rel=2e-2)
    assert float(row["MFU"].rstrip("%")) > 0
    # Without --peak-tflops a CPU has no listed peak: no MFU, and the report says why.
    assert _table_row((tmp_path / "f32" / "lm_2agents.md").read_text(), "allreduce")["MFU"] == ""
    assert "no known peak for cpu" in (tmp_path / "f32" / "lm_2agents.md").read_text()


def test_peaks_by_device_kind():
    lm = _example("train_lm")
    # The names jax gives these GPUs (device_kind), dense peaks: the datasheets
    # "with sparsity" figures halved; float32 runs as TF32.
    assert lm.peak_tflops("NVIDIA H200", "bfloat16") == 989.4
    assert lm.peak_tflops("NVIDIA H100 80GB HBM3", "float32") == 494.7
    assert lm.peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.5
    assert lm.peak_tflops("cpu", "float32") is None


# -- backends ---------------------------------------------------------------------------------


def _same_training(got: dict, simulated: dict, *, measured: bool) -> None:
    assert list(got) == list(simulated) == ["atc one-peer", "diloco H=4 top_k(0.05)"]
    for label in got:
        for row, expected in zip(got[label], simulated[label], strict=True):
            assert row["step"] == expected["step"], label
            for key in ("val_bpb", "train_bpb"):
                if expected[key] is not None:
                    # float32, reduced in another order: the same training to rounding
                    np.testing.assert_allclose(row[key], expected[key], rtol=1e-4,
                                               err_msg=f"{label} {key}")
            assert row["sent_bytes"] == expected["sent_bytes"], label
            if measured:  # what jaxfog.comm_stats counted is the modelled figure
                assert row["measured_sent_bytes"] == row["sent_bytes"], label


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """The two methods' training on 2 simulated agents, the reference."""
    out = tmp_path_factory.mktemp("sim")
    return _example("train_lm").main(["--out", str(out), *TWO_METHODS])["results"]


def test_mpi_processes_train_like_the_simulated_agents(tmp_path, simulated):
    command = [sys.executable, "-m", "jaxfog.cli", "run", "-np", "2", sys.executable,
               str(EXAMPLES / "train_lm.py"), "--out", str(tmp_path / "mpi"), *TWO_METHODS]
    run = run_command(command, timeout=240, env=launch_environment({"JAXFOG_TIMEOUT": "60"}))
    assert run.ok, run.report()
    assert "2 MPI processes" in run.output
    _same_training(_report(tmp_path / "mpi", "lm_2procs")["results"], simulated, measured=True)


def test_one_process_mesh_trains_like_the_simulated_agents(tmp_path, simulated):
    command = [sys.executable, str(EXAMPLES / "train_lm.py"), "--out", str(tmp_path / "mesh"),
               "--mesh", *TWO_METHODS]
    run = run_command(command, timeout=240, env=launch_environment())
    assert run.ok, run.report()
    assert "2 agents on a device mesh" in run.output
    _same_training(_report(tmp_path / "mesh")["results"], simulated, measured=False)


def test_unigram_bits_per_byte_is_the_entropy_of_the_byte_frequencies():
    lm = _example("train_lm")
    data = lm.corpus(2, lm.SIZES["tiny"], data_mb=1, iid=False, seed=0)
    # The training bytes' frequencies (add-one; the streams as the agents
    # train on them, cut to one length) scored on the validation bytes.
    counts = np.bincount(data.streams.ravel(), minlength=256) + 1
    predicted = data.validation[:, 1:].ravel()
    cross_entropy = -np.mean(np.log2(counts / counts.sum())[predicted])
    assert abs(data.unigram_bpb - cross_entropy) < 0.05
    # Gibbs: no model of the validation bytes beats their own frequencies, and
    # the training frequencies come close (held-out Python source is Python
    # source). Which of training and validation is the more predictable depends
    # on the stdlib's version: 3.12's held-out files are, 3.11's are not.
    seen = np.bincount(predicted, minlength=256) / predicted.size
    entropy = -np.sum(seen[seen > 0] * np.log2(seen[seen > 0]))
    assert entropy <= data.unigram_bpb < entropy + 0.5
    assert math.isclose(data.unigram_bpb, lm.corpus(2, lm.SIZES["tiny"], data_mb=1, iid=True,
                                                    seed=0).unigram_bpb, rel_tol=0.05)
    # Each agent its own files, no file both trained on and held out.
    first, second = data.files
    assert not set(first) & set(second) and first[-1] < second[0]
