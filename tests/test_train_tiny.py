"""The tiny trainers' models and objectives (tools/train_ouro_tiny.py, tools/train_huginn_tiny.py).

Their checkpoints are only worth benchmarking if the torch models are the published layouts
(tests/hf_reference.py's float64 references read the saved folders) and the objectives are
Ouro's (arXiv 2510.25741 eq. 3, 4 and 6): the exit distribution sums to one, stage 1 is the
p-weighted loss minus beta times its entropy, stage 2 moves the gate and nothing else. Needs
torch and safetensors (skipped without them); a few seconds.
"""
import json
import math
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
import train_huginn_tiny as huginn                              # noqa: E402
import train_ouro_tiny as ouro                                  # noqa: E402
from hf_reference import huginn_logits, ouro_logits             # noqa: E402

TOKENS = np.random.default_rng(5).integers(0, 256, 20).tolist()


def saved(folder):
    from safetensors.numpy import load_file
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        return {k: v.astype(np.float64) for k, v in tensors.items()}, json.load(f)


def perturb(model, seed=1):
    """Non-trivial gains, biases and gate (the inits are ones and zeros)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.weights.items():
            if p.ndim == 1 or "qk_bias" in name or "early_exit" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


def ouro_model(tmp_path, objective="ouro"):
    args = ouro.parse_args([str(tmp_path / "ouro"), "--d-model", "32", "--n-heads", "2",
                            "--ffn-dim", "48", "--layers", "2", "--passes", "3",
                            "--max-seq-len", "64", "--objective", objective])
    torch.manual_seed(0)
    model = ouro.OuroLM(args)
    perturb(model)
    return model, args


def test_ouro_model_is_the_reference_layout(tmp_path):
    model, args = ouro_model(tmp_path)
    ouro.save(model, args)
    tensors, config = saved(args.out)
    assert np.any(tensors["model.early_exit_gate.weight"] != 0)
    with torch.no_grad():
        ours = model(torch.tensor([TOKENS]))[0].double().numpy()
    np.testing.assert_allclose(ours, ouro_logits(tensors, config, TOKENS), atol=2e-4)


def test_last_objective_saves_a_zero_gate(tmp_path):
    model, args = ouro_model(tmp_path, objective="last")
    assert ouro.GATE[0] not in model.weights
    ouro.save(model, args)
    tensors, _ = saved(args.out)
    assert not tensors["model.early_exit_gate.weight"].any()


def test_exit_distribution_and_stage1_loss(tmp_path):
    model, _ = ouro_model(tmp_path)
    x = torch.tensor([TOKENS[:-1]])
    y = torch.tensor([TOKENS[1:]])
    with torch.no_grad():
        states = model.states(x)
        lam = [v.double().numpy()[0] for v in model.exit_lambdas(states)]
        ce = [torch.nn.functional.cross_entropy(model.head(h)[0], y[0], reduction="none")
              .double().numpy() for h in states]
        p = ouro.exit_distribution(model.exit_lambdas(states)).double().numpy()[:, 0]
        loss, _ = ouro.ouro_stage1_loss(0.1)(model, x, y)
    np.testing.assert_allclose(p.sum(0), 1, atol=1e-6)
    want_p = [lam[0], (1 - lam[0]) * lam[1], (1 - lam[0]) * (1 - lam[1])]     # 3 passes
    np.testing.assert_allclose(p, want_p, atol=1e-6)
    entropy = -(p * np.log(p)).sum(0)
    want = ((p * np.stack(ce)).sum(0) - 0.1 * entropy).mean()
    assert math.isclose(loss.item(), want, rel_tol=1e-5)


@pytest.mark.parametrize("target", ["paper", "next"])
def test_stage2_moves_the_gate_alone(tmp_path, target):
    model, _ = ouro_model(tmp_path)
    x = torch.tensor([TOKENS[:-1]])
    y = torch.tensor([TOKENS[1:]])
    loss, _ = ouro.ouro_gate_loss(50.0, 0.005, target)(model, x, y)
    loss.backward()
    for name, p in model.weights.items():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == (name in ouro.GATE), name
    # eq. 6 by hand: the labels from the detached per-pass losses
    with torch.no_grad():
        states = model.states(x)
        ce = torch.stack([torch.nn.functional.cross_entropy(model.head(h)[0], y[0],
                                                            reduction="none") for h in states])
        w = torch.sigmoid(50 * ((ce[:-1] - ce[1:]).clamp_min(0) - 0.005))
        lam = torch.stack([v[0] for v in model.exit_lambdas(states)])
        lam = lam[1:] if target == "paper" else lam[:-1]
        bce = -(w * torch.log(1 - lam) + (1 - w) * torch.log(lam))
    assert math.isclose(loss.item(), bce.mean(1).sum().item() / 3, rel_tol=1e-5)


def test_huginn_model_is_the_reference_layout(tmp_path):
    args = huginn.parse_args([str(tmp_path / "huginn"), "--d-model", "32", "--n-heads", "2",
                              "--ffn-dim", "48", "--max-seq-len", "64"])
    torch.manual_seed(0)
    model = huginn.HuginnLM(args)
    perturb(model)
    huginn.save(model, args)
    tensors, config = saved(args.out)
    for depth in (1, 3):
        with torch.no_grad():
            ours = model(torch.tensor([TOKENS]), depth)[0].double().numpy()
        np.testing.assert_allclose(ours, huginn_logits(tensors, config, TOKENS, depth),
                                   atol=2e-4)


def test_huginn_depth_sampler(tmp_path):
    args = huginn.parse_args([str(tmp_path / "h"), "--mean-recurrence", "4"])
    depths = []

    class Probe:
        def __call__(self, x, depth, with_grad):
            depths.append(depth)
            return torch.zeros(x.shape + (256,), requires_grad=True)
    loss_fn = huginn.random_depth_loss(args)
    for _ in range(400):
        loss_fn(Probe(), torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    assert min(depths) >= 1 and max(depths) <= 16
    assert 4.5 < np.mean(depths) < 5.5                # 1 + Poisson(rate), E[rate] = 4, as Huginn
    loss_fn = huginn.random_depth_loss(args)          # the same draws again
    first = list(depths)
    depths.clear()
    for _ in range(400):
        loss_fn(Probe(), torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    assert depths == first
