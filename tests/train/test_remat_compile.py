"""Recomputation policies and regional compile change memory and speed, never the numbers."""

import json
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchloom.config.errors import ConfigError
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.train.compile import CompileConfig, compile_regions
from torchloom.train.loss import cross_entropy_sum
from torchloom.train.remat import RematConfig, apply_remat, memory_budget, recompute_weight_casts


def tiny(num_layers: int = 4) -> nn.Module:
    config = resolve_model_config(
        ModelConfig(name="llama3", flavor="debug", overrides={"num_layers": num_layers})
    )
    model = build_model(config)
    model.init_weights(0)
    return model


def loss_grads_saved(model: nn.Module) -> tuple[float, dict[str, torch.Tensor], int]:
    """Loss, gradients, and bytes of activations autograd kept for the backward pass."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)
    labels = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if not isinstance(t, nn.Parameter):
            saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy_sum(model(tokens), labels) / labels.numel()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, saved


@pytest.fixture(scope="module")
def reference():
    return loss_grads_saved(tiny())


@pytest.mark.parametrize("mode", ["full", "selective", "every_k"])
def test_remat_gives_identical_gradients_and_keeps_less(reference, mode):
    model = tiny()
    apply_remat(model.layers, RematConfig(mode=mode), compile_enabled=False)
    loss, grads, saved = loss_grads_saved(model)
    diff = max((grads[n] - g).abs().max().item() for n, g in reference[1].items())
    print(f"{mode}: saved {saved / 2**20:.2f} MiB vs {reference[2] / 2**20:.2f} MiB, "
          f"max |grad diff| {diff:.1e}")  # fmt: skip
    assert loss == reference[0] and diff == 0.0
    assert saved < reference[2]


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: str) -> Counter:
    """aten ops the backward pass runs (recomputation shows up as extra forward ops)."""
    model = tiny()
    apply_remat(model.layers, RematConfig(mode=mode, every_k=2), compile_enabled=False)
    tokens = torch.randint(0, model.config.vocab_size, (2, 64))
    loss = cross_entropy_sum(model(tokens), tokens) / tokens.numel()
    with CountOps() as counter:
        loss.backward()
    return counter.counts


def test_what_each_policy_recomputes():
    """4 blocks of 7 matmuls: full recomputes 6 per block in backward (the last, down, is not
    needed: recomputation stops once the saved tensors are back), every_k (k=2) those of
    blocks 0 and 2, selective none (it keeps matmul and attention outputs), though it redoes
    the pointwise ops such as SiLU."""
    ops = {mode: backward_ops(mode) for mode in ("none", "full", "every_k", "selective")}
    extra_mm = {m: ops[m]["mm"] - ops["none"]["mm"] for m in ops}
    extra_silu = {m: ops[m]["silu"] - ops["none"]["silu"] for m in ops}
    print(f"matmuls recomputed {extra_mm}, silu recomputed {extra_silu}")
    assert extra_mm == {"none": 0, "full": 24, "every_k": 12, "selective": 0}
    assert extra_silu == {"none": 0, "full": 4, "every_k": 2, "selective": 4}


def test_remat_config_errors():
    with pytest.raises(ConfigError, match="unknown aten op 'mmm'.*Did you mean 'mm'"):
        RematConfig(mode="selective", save_ops=["mmm"]).validate()
    with pytest.raises(ConfigError, match="needs --compile.enabled true"):
        apply_remat(tiny().layers, RematConfig(mode="budget"), compile_enabled=False)
    with pytest.raises(ConfigError, match="memory_budget"):
        RematConfig(mode="budget", memory_budget=0.0).validate()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_regional_compile_keeps_numbers_and_names(reference, backend):
    model = tiny()
    names = list(model.state_dict())
    compiled = compile_regions(model, CompileConfig(enabled=True, backend=backend))
    assert compiled == [f"layers.{i}" for i in range(4)]
    loss, grads, _ = loss_grads_saved(model)
    diff = max((grads[n] - g).abs().max().item() for n, g in reference[1].items())
    print(f"{backend}: |loss diff| {abs(loss - reference[0]):.1e}, max |grad diff| {diff:.1e}")
    assert list(model.state_dict()) == names
    assert abs(loss - reference[0]) < 1e-5 and diff < 1e-5


def test_memory_budget_with_compile_keeps_numbers(reference):
    model = tiny()
    # aot_eager_decomp_partition runs the same min-cut partitioner as inductor, which reads the
    # budget, without inductor's code generation.
    config = CompileConfig(enabled=True, backend="aot_eager_decomp_partition")
    remat = RematConfig(mode="budget", memory_budget=0.3)
    apply_remat(model.layers, remat, compile_enabled=True)
    compile_regions(model, config, memory_budget=memory_budget(remat))
    loss, grads, saved = loss_grads_saved(model)
    # The budget is the compiled regions' own, not a process-wide switch.
    assert torch._functorch.config.activation_memory_budget == 1.0
    diff = max((grads[n] - g).abs().max().item() for n, g in reference[1].items())
    print(f"budget 0.3: saved {saved / 2**20:.2f} MiB vs {reference[2] / 2**20:.2f} MiB, "
          f"max |grad diff| {diff:.1e}")  # fmt: skip
    assert abs(loss - reference[0]) < 1e-5 and diff < 1e-5
    # Compiled without a budget these blocks keep ~0.82 of eager's bytes (torch 2.13); with
    # 0.3, ~0.63: the budget reached the partitioner.
    assert saved < 0.75 * reference[2]


def test_compile_regions_by_name_and_errors():
    model = tiny()
    compiled = compile_regions(
        model, CompileConfig(enabled=True, backend="eager", regions=["layers.1", "norm", "SwiGLU"])
    )
    assert compiled == ["layers.0.mlp", "layers.1", "layers.2.mlp", "layers.3.mlp", "norm"]
    with pytest.raises(ConfigError, match="'Blok' matches no module.*Did you mean 'Block'"):
        compile_regions(tiny(), CompileConfig(enabled=True, regions=["Blok"]))


def test_eager_types_stay_out_of_compiled_regions():
    compiled = compile_regions(
        tiny(2), CompileConfig(enabled=True, backend="eager"), eager_types=("RMSNorm",)
    )
    assert compiled == ["layers.0.attention", "layers.0.mlp", "layers.1.attention", "layers.1.mlp"]


@torch.compiler.disable
def _opaque(x: torch.Tensor) -> torch.Tensor:  # as fla hides its kernels from Dynamo
    return x * 2


class _CallsOpaque(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _opaque(x.sin()).cos()


def test_graph_break_types_compile_around_opaque_kernels():
    """A block holding a module that calls a kernel Dynamo does not trace fails to compile as
    one graph (fullgraph, the default); named in graph_break_types it compiles in pieces."""
    x = torch.randn(3, 4)
    for breaks in ((), ("_CallsOpaque",)):
        torch._dynamo.reset()
        model = nn.Sequential(nn.Sequential(_CallsOpaque()))
        compile_regions(model, CompileConfig(enabled=True, backend="eager", regions=["0"]),
                        graph_break_types=breaks)  # fmt: skip
        if not breaks:
            with pytest.raises(torch._dynamo.exc.Unsupported):
                model(x)
        else:
            torch.testing.assert_close(model(x), (2 * x.sin()).cos())


class _OpaqueMLP(nn.Module):
    """The block's MLP with its output passed through a kernel Dynamo does not trace."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _opaque(self.mlp(x)) / 2


@pytest.mark.parametrize(
    "mode, named", [("full", True), ("selective", True), ("full", False)],
    ids=["full", "selective", "full-fullgraph-off"],
)  # fmt: skip
def test_remat_around_regions_with_graph_breaks_still_compiles(reference, mode, named):
    """Checkpointed whole, a region with a graph break runs all eagerly (Dynamo cannot break
    a graph inside the checkpoint; found on the H200: every hybrid block eager with fla);
    compile_regions compiles what the checkpoint wraps and checkpoints around it instead."""
    model = tiny()
    for block in model.layers.values():
        block.mlp = _OpaqueMLP(block.mlp)
    apply_remat(model.layers, RematConfig(mode=mode), compile_enabled=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # The break named (graph_break_types, as the builders name fla's mixers), or any break
    # allowed (--compile.fullgraph false, as benchmarks/hybrid.py compiles).
    config = CompileConfig(enabled=True, backend="aot_eager", fullgraph=named)
    compile_regions(model, config, graph_break_types=("_OpaqueMLP",) if named else ())
    loss, grads, saved = loss_grads_saved(model)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    diff = max((grads[n.replace(".mlp.", ".mlp.mlp.")] - g).abs().max().item()
               for n, g in reference[1].items())  # fmt: skip
    print(f"{mode}: {graphs} graphs, saved {saved / 2**20:.2f} MiB of {reference[2] / 2**20:.2f}")
    assert graphs >= 2  # the code before and after the opaque kernel, compiled
    assert abs(loss - reference[0]) < 1e-5 and diff < 1e-5
    assert saved < reference[2]  # and still recomputed


def test_hybrid_blocks_compile_once_around_opaque_fla(monkeypatch):
    """The Gated DeltaNet blocks as they compile on a GPU with fla, emulated on the CPU: impl
    "auto" takes the fla branch, whose function Dynamo may not enter (here the chunked form
    behind torch.compiler.disable, as the real one is). A 12-layer hybrid with full remat,
    each block compiled with graph breaks: a few graphs serve every block (without the
    checkpoint moved outside, none: every block ran eagerly, as on the H200), gradients as
    eager's."""
    import torchloom.kernels.delta_rule as delta_rule
    from torchloom.train.builders import DELTA_RULE_MIXERS

    @torch.compiler.disable
    def opaque_chunked(q, k, v, g, beta, state, scale, doc_ids_BT, normalize_qk):
        return delta_rule.delta_rule(q, k, v, g, beta, state, scale, impl="torch",
                                     doc_ids_BT=doc_ids_BT, normalize_qk=normalize_qk)  # fmt: skip

    monkeypatch.setattr(delta_rule, "_fla_suits", lambda *inputs: True)
    monkeypatch.setattr(delta_rule, "_delta_rule_fla", opaque_chunked)
    config = resolve_model_config(
        ModelConfig(name="qwen3_next", flavor="debug", overrides={"num_layers": 12})
    )
    results = []
    for compiled in (False, True):
        model = build_model(config)
        model.init_weights(0)
        if compiled:
            apply_remat(model.layers, RematConfig(mode="full"), compile_enabled=True)
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compile_regions(model, CompileConfig(enabled=True, backend="eager"),
                            graph_break_types=DELTA_RULE_MIXERS)  # fmt: skip
        results.append(loss_grads_saved(model))
    counters = torch._dynamo.utils.counters
    graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["ok"]
    print(
        f"{graphs} graphs, {frames} frames for 12 blocks; graph breaks: {sum(counters['graph_break'].values())}"
    )
    assert 2 <= graphs < 8 and frames < 8
    (loss, grads, _), (loss_c, grads_c, _) = results
    assert abs(loss - loss_c) < 1e-5
    assert max((grads_c[n] - g).abs().max().item() for n, g in grads.items()) < 1e-5


def _saved_under_autocast(model: nn.Module) -> tuple[dict[str, torch.Tensor], int, int]:
    """Gradients of a bf16-autocast step, and what autograd kept for its backward: bytes of
    activations (tensors that are not parameters), and bytes of bf16 tensors shaped like a
    parameter (the forward's casts of the weights)."""
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)
    saved = weight_copies = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved, weight_copies
        if not isinstance(t, nn.Parameter):
            saved += t.numel() * t.element_size()
            if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
                weight_copies += t.numel() * t.element_size()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    (cross_entropy_sum(logits.float(), tokens) / tokens.numel()).backward()
    return {n: p.grad for n, p in model.named_parameters()}, saved, weight_copies


def _block_matrix_bytes_bf16(model: nn.Module) -> int:
    return sum(2 * p.numel() for p in model.layers.parameters() if p.dim() == 2)


def test_recompute_weight_casts_pass_frees_the_bf16_copies():
    """The joint-graph pass behind --remat.weight_casts recompute, run before the min-cut
    partitioner that inductor uses (without inductor's code generation, so fast): the compiled
    blocks stop keeping bf16 copies of their weights (every matrix's copy, 2 bytes an element,
    is gone from what the backward holds), and the gradients do not change by a bit."""

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from torchloom.train.weight_casts import RecomputeInputCasts

    def backend(recompute: bool):
        def partition(joint, inputs, **kwargs):
            if recompute:
                RecomputeInputCasts()(joint.graph)
            return min_cut_rematerialization_partition(joint, inputs, **kwargs)

        return aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition)

    results = []
    for recompute in (False, True):
        torch._dynamo.reset()
        model = tiny(2)
        for block in model.layers.values():
            block.compile(backend=backend(recompute), fullgraph=True)
        results.append(_saved_under_autocast(model))
    (grads, saved, copies), (grads_r, saved_r, copies_r) = results
    matrices = _block_matrix_bytes_bf16(model)
    print(f"kept {saved} -> {saved_r} bytes; bf16 weight copies {copies} -> {copies_r} "
          f"(block matrices in bf16: {matrices})")  # fmt: skip
    assert copies == matrices and copies_r == 0
    assert saved - saved_r == matrices
    assert all(torch.equal(grads_r[n], g) for n, g in grads.items())


@pytest.fixture
def no_compile_cache():
    """Inductor's and AOTAutograd's caches off: a graph compiled before (an earlier run of
    these tests, kept on disk) would come back already partitioned, without the pass running,
    so a broken pass would go unseen. (The configs' own patch: monkeypatch's undo deletes a
    config module's entry.)"""
    inductor = torch._inductor.config.patch(fx_graph_cache=False)
    with inductor, torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.slow
def test_recompute_weight_casts_with_inductor(no_compile_cache):
    """The option through compile_regions with inductor (its CPU code here)."""
    results = []
    for casts in ("keep", "recompute"):
        torch._dynamo.reset()
        model = tiny(2)
        remat = RematConfig(weight_casts=casts)
        apply_remat(model.layers, remat, compile_enabled=True)
        compile_regions(model, CompileConfig(enabled=True),
                        recompute_casts=recompute_weight_casts(remat))  # fmt: skip
        results.append(_saved_under_autocast(model))
    (grads, saved, copies), (grads_r, saved_r, copies_r) = results
    print(f"kept {saved} -> {saved_r} bytes; bf16 weight copies {copies} -> {copies_r}")
    assert copies == _block_matrix_bytes_bf16(model) and copies_r == 0
    assert saved - saved_r == copies
    assert all(torch.equal(grads_r[n], g) for n, g in grads.items())
    # The pass was set for these regions' compilation only.
    assert torch._inductor.config.joint_custom_pre_pass is None


@pytest.mark.slow
def test_trainer_recomputes_weight_casts_with_the_same_losses(
    tmp_path, monkeypatch, no_compile_cache
):
    """`torchloom train --remat.weight_casts recompute` (bf16 autocast, compiled blocks, every
    other block recomputed): the pass runs on the compiled blocks' graphs, and the losses are
    keep's, bit for bit."""
    from torchloom.cli import resolve_job
    from torchloom.train.trainer import Trainer
    from torchloom.train.weight_casts import RecomputeInputCasts

    calls = []
    original = RecomputeInputCasts.__call__
    monkeypatch.setattr(RecomputeInputCasts, "__call__",
                        lambda self, graph: calls.append(graph) or original(self, graph))  # fmt: skip
    losses = {}
    for casts in ("keep", "recompute"):
        torch._dynamo.reset()
        _, job = resolve_job(
            ["--recipe", "debug", "--output.dir", str(tmp_path / casts), "--training.steps", "3",
             "--training.mixed_precision", "bf16", "--compile.enabled", "true",
             "--remat.mode", "every_k", "--remat.weight_casts", casts,
             "--metrics.tensorboard", "false", "--training.sample_tokens", "0"]
        )  # fmt: skip
        Trainer(job).train()
        lines = (tmp_path / casts / "metrics.jsonl").read_text().splitlines()
        losses[casts] = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
        assert bool(calls) == (casts == "recompute")
    print(losses)
    assert len(losses["keep"]) == 3 and losses["keep"] == losses["recompute"]


def test_weight_casts_config_errors():
    with pytest.raises(ConfigError, match="--remat.weight_casts must be one of keep, recompute"):
        RematConfig(weight_casts="drop").validate()
    with pytest.raises(ConfigError, match="weight_casts recompute .* needs --compile.enabled true"):
        apply_remat(tiny().layers, RematConfig(weight_casts="recompute"), compile_enabled=False)
    from torchloom.cli import resolve_job

    argv = ["--remat.weight_casts", "recompute", "--compile.enabled", "true"]
    with pytest.raises(ConfigError, match="is an inductor pass; --compile.backend aot_eager"):
        resolve_job([*argv, "--compile.backend", "aot_eager"])
