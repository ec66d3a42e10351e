"""The one-launch decode step (torchloom/kernels/fused_decode.py, generate/fused_step.py).

The PyTorch reference of the step against the model's own forward over its cache (so
``decode_weights`` describes the model the kernel will read); which models the fused step
refuses and how the generator says so; the kernel against the reference in Triton's
interpreter (this file run as a script with TRITON_INTERPRET=1, fp32) at several tilings,
positions (the first, past several key blocks, the cache's last index) and program counts,
and the generator decoding with it against the generator on the model's forward; the plan's
waits, simulated from its tables (each met by earlier tasks, counting exactly the tasks that
write what its reader reads); the kernel compiled for sm_90 at the Llama-3.2-1B shape in bf16
without spilling; on a CUDA GPU, the kernel in bf16 at the 1B layer shapes and the generator
from CUDA graphs.
"""

from __future__ import annotations

import copy
import inspect
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.generate.fused_step import decode_weights, fused_step_problem
from torchloom.kernels.attention_mask import AttentionMask
from torchloom.kernels.fused_decode import (
    DecodeWeights,
    FusedDecodeStep,
    LayerWeights,
    fused_decode_reference,
)
from torchloom.models import ModelConfig, build_model, resolve_model_config


def tiny(family: str = "llama3", **changes) -> torch.nn.Module:
    config = replace(resolve_model_config(ModelConfig(name=family, flavor="debug")), **changes)
    model = build_model(config)
    model.init_weights(0)
    return model.eval()


def test_reference_matches_the_model() -> None:
    """decode_weights + fused_decode_reference, step by step after a prefill, against the
    model's forward over its own cache: the same log-probabilities (fp32, to rounding) and
    the same keys and values cached."""
    model = tiny()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ours, theirs = model.new_cache(1, 32, "cpu", torch.float32), model.new_cache(1, 32, "cpu", torch.float32)  # fmt: skip
    slot = torch.tensor([0])
    with torch.no_grad():
        positions = torch.arange(len(prompt))[None]
        for cache in (ours, theirs):
            model(torch.tensor([prompt]), positions, cache=cache.bind(slot, positions))
        weights = decode_weights(model, ours)
        token = prompt[-1]
        for position in range(len(prompt), len(prompt) + 4):
            logprobs, best, best_logprob = fused_decode_reference(weights, token, position)
            at = torch.tensor([[position]])
            logits = model(torch.tensor([[token]]), at, cache=theirs.bind(slot, at))[0, 0]
            want = torch.log_softmax(logits, -1)
            assert (logprobs - want).abs().max() < 1e-5
            assert best == int(want.argmax()) and abs(best_logprob - float(want.max())) < 1e-5
            token = best
    for mine, reference in zip(ours.states.values(), theirs.states.values()):
        assert torch.allclose(mine.k, reference.k, atol=1e-6)
        assert torch.allclose(mine.v, reference.v, atol=1e-6)


def test_refusals() -> None:
    """Models other than Llama-shaped ones are named with their reason; step_kernel 'triton'
    refuses them in one line (and the CPU without the interpreter); 'auto' runs the forward
    there instead."""
    llama = tiny()
    assert fused_step_problem(llama, llama.new_cache(1, 8, "cpu", torch.float32)) is None
    windowed = tiny()
    windowed.layers["1"].attention.mask = AttentionMask(window=4)
    cases = {
        "qwen3": (tiny("qwen3"), "q/k norms"),
        "deepseek_v3": (tiny("deepseek_v3"), "not a plain decoder"),
        "batch_invariant": (tiny(batch_invariant=True), "batch-invariant"),
        "window": (windowed, "layer 1: its attention mask is"),
    }
    for name, (model, reason) in cases.items():
        problem = fused_step_problem(model, model.new_cache(1, 8, "cpu", torch.float32))
        assert problem is not None and reason in problem, (name, problem)
    qwen3 = cases["qwen3"][0]
    with pytest.raises(ValueError, match="step_kernel 'triton' cannot run .*q/k norms"):
        Generator(qwen3, max_batch=1, max_len=16, step_kernel="triton")
    with pytest.raises(ValueError, match="step_kernel must be one of"):
        Generator(llama, max_batch=1, max_len=16, step_kernel="fused")
    with pytest.raises(ValueError, match="runs on CUDA .*not on cpu"):
        Generator(llama, max_batch=1, max_len=16, step_kernel="triton")
    # "auto": the forward wherever "triton" is refused, the CPU included (graphs None: the
    # eager forward; no DecodeGraphs holds a fused step)
    for model in (qwen3, llama, cases["batch_invariant"][0]):
        assert Generator(model, max_batch=1, max_len=16, step_kernel="auto").graphs is None
    assert Generator(llama, max_batch=1, max_len=16).graphs is None  # "auto" by default
    # The default the docs promise; on CUDA test_kernel_matches_the_reference_on_gpu's
    # fused="default" row checks that it picks the fused step (on the CPU "auto" runs the forward).
    assert inspect.signature(Generator).parameters["step_kernel"].default == "auto"
    weights = random_weights(64, 4, 2, 16, 192, 300, layers=1, max_len=8, device="cpu",
                             dtype=torch.float32)  # fmt: skip
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="schedule must be 'dynamic' or 'static'"):
        FusedDecodeStep(weights, one, one, schedule="round-robin")
    with pytest.raises(ValueError, match="small_waves .* needs waves"):
        FusedDecodeStep(weights, one, one, waves=None, small_waves=1)
    with pytest.raises(ValueError, match="at least 1; got small_waves=0"):
        FusedDecodeStep(weights, one, one, small_waves=0)
    with pytest.raises(ValueError, match="prefetch must be at least 0"):
        FusedDecodeStep(weights, one, one, prefetch=-1)
    with pytest.raises(ValueError, match="prefetch asks L2 .* needs a CUDA device .*got cpu"):
        FusedDecodeStep(weights, one, one, prefetch=2)
    mixed = tiny()
    mixed.norm.weight.data = mixed.norm.weight.data.double()
    problem = fused_step_problem(mixed, mixed.new_cache(1, 8, "cpu", torch.float32))
    assert problem is not None and "several dtypes" in problem


def random_weights(dim: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int,
                   layers: int, max_len: int, device: str, dtype: torch.dtype) -> DecodeWeights:  # fmt: skip
    """Unit-scale random weights and a random cache (so every position attends to something)."""
    gen = torch.Generator(device).manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * shape[-1] ** -0.5).to(dtype)

    def gain() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(dim, device=device, generator=gen)).to(dtype)

    def cache() -> torch.Tensor:
        return torch.randn(kv_heads, max_len, head_dim, device=device, generator=gen).to(dtype)

    blocks = [LayerWeights(gain(), r(heads * head_dim, dim), r(kv_heads * head_dim, dim),
                           r(kv_heads * head_dim, dim), r(dim, heads * head_dim), gain(),
                           r(ffn, dim), r(ffn, dim), r(dim, ffn), cache(), cache())
              for _ in range(layers)]  # fmt: skip
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    embed = torch.randn(vocab, dim, device=device, generator=gen).to(dtype)
    return DecodeWeights(embed, blocks, gain(), r(vocab, dim), heads, kv_heads, head_dim, 1e-5,
                         inv_freq, rope_scale=1.0)  # fmt: skip


def check_kernel(weights: DecodeWeights, positions: list[int], tolerance: float, **tiling) -> str:
    """The kernel against the reference at each position (each from the same cache): the
    log-probabilities, the argmax and its log-probability, the cache written, and the next
    step's inputs it leaves (the argmax, the position one further, clamped)."""
    device = weights.embed.device
    max_len = weights.layers[0].k_cache.shape[1]
    worst = 0.0
    for position in positions:
        mine, theirs = copy.deepcopy(weights), copy.deepcopy(weights)
        want, best, best_logprob = fused_decode_reference(theirs, 7, position)
        token_1 = torch.tensor([7], device=device)
        position_1 = torch.tensor([position], device=device)
        logprobs_1V, best_21 = FusedDecodeStep(mine, token_1, position_1, **tiling)()
        error = (logprobs_1V[0] - want).abs().max().item()
        worst = max(worst, error)
        assert error < tolerance, f"position {position} {tiling}: max |logprob diff| {error:.1e}"
        assert int(best_21[0, 0]) == best == int(token_1[0]), (best_21, best, token_1)
        assert abs(float(best_21[1, 0]) - best_logprob) < tolerance
        assert int(position_1[0]) == min(position + 1, max_len - 1)
        for a, b in zip(mine.layers, theirs.layers):
            for got, expected in ((a.k_cache, b.k_cache), (a.v_cache, b.v_cache)):
                gap = (got.float() - expected.float()).abs().max().item()
                assert gap <= tolerance, f"position {position}: cache differs by {gap:.1e}"
    return f"kernel {tiling} at positions {positions}: max |logprob diff| {worst:.1e}"


def with_a_tie(weights: DecodeWeights, position: int) -> DecodeWeights:
    """``weights`` with the head row of the reference's argmax at ``position`` repeated half
    the vocabulary away, in another strip: equal logits, of which the lower row must win."""
    _, best, _ = fused_decode_reference(copy.deepcopy(weights), 7, position)
    tied = copy.deepcopy(weights)
    tied.head[(best + tied.head.shape[0] // 2) % tied.head.shape[0]] = tied.head[best]
    return tied


def check_generator(device: str, compile: bool = False, fused: str = "triton") -> str:
    """The llama3 debug model (fp32) generating 3 greedy requests through 2 slots: slot 0 alone
    (once the two shorter requests have passed through slot 1) decodes by the fused step, two
    rows by the forward. The same tokens as the generator on the forward alone,
    log-probabilities within 1e-4. ``fused``: the step_kernel that picks the fused step
    ("auto" on CUDA, which also leaves a qwen3 model on its forward; "default": none passed,
    which is "auto")."""
    model = tiny().to(device)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9] * 11]
    results, fused_steps = {}, []
    for impl in ("torch", fused):
        chosen = {} if impl == "default" else {"step_kernel": impl}
        generator = Generator(model, max_batch=2, max_len=32, compile=compile,
                              cuda_graphs=device == "cuda", **chosen)  # fmt: skip
        assert (generator.graphs is not None and generator.graphs._fused is not None) == (
            impl != "torch"
        ), impl
        if impl != "torch" and device == "cpu":  # count the fused steps (no graphs here)
            step = generator.graphs._fused
            generator.graphs._fused = lambda step=step: fused_steps.append(1) or step()
        requests = [Request(p, SamplingParams(max_new_tokens=n, temperature=0.0))
                    for p, n in zip(prompts, (16, 4, 3))]  # fmt: skip
        results[impl] = generator.generate(requests)
    if device == "cpu":
        assert len(fused_steps) >= 4, f"the fused step ran {len(fused_steps)} times"
    worst = 0.0
    if fused != "triton":
        qwen3 = Generator(tiny("qwen3").to(device), max_batch=1, max_len=16, step_kernel="auto")
        assert qwen3.graphs is None or qwen3.graphs._fused is None
    for ours, reference in zip(results[fused], results["torch"], strict=True):
        assert ours.tokens == reference.tokens, (ours.tokens, reference.tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(ours.logprobs, reference.logprobs)))
    assert worst < 1e-4, f"generator: max |logprob diff| {worst:.1e}"
    return f"generator (compile {compile}, {fused}), fused vs forward: same tokens, logprobs within {worst:.1e}"  # fmt: skip


def simulate_schedule(step: FusedDecodeStep) -> dict[int, list[tuple[int, int]]]:
    """Run ``step``'s task list in order as the kernel reads its tables (no arithmetic): each
    task's wait must already be met when it is taken (programs take tasks in order, so a wait
    on a later task could deadlock), every wait's count must be exactly what its counter
    reaches (fewer: a reader starts before its rows are written; more: it never starts), and a
    reader waiting on a group's or a chunk's counter must read only rows counted there.
    Returns each such counter's written scratch ranges [start, end)."""
    tasks, waits = step.tasks.tolist(), step.waits.tolist()
    matrices, layers, stages = step.matrices.tolist(), step.layers.tolist(), step.stages.tolist()
    w = step.weights
    hd, group, splits = w.head_dim, w.heads // w.kv_heads, step.splits
    counts = [0] * len(step.counters)
    written: dict[int, list[tuple[int, int]]] = {}
    head_stage = next(m[8] for m in matrices if m[9])

    def wait_then_read(wait: int, task: int, *ranges: tuple[int, int]) -> None:
        counter, need = waits[wait]
        assert counts[counter] >= need, f"task {task} waits for a later task ({tasks[task]})"
        if counter in written:  # a group's or a chunk's counter: only rows counted there
            merged: list[list[int]] = []
            for lo, hi in sorted(written[counter]):
                if merged and lo <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], hi)
                else:
                    merged.append([lo, hi])
            for lo, hi in ranges:
                assert any(a <= lo and hi <= b for a, b in merged), (task, counter, lo, hi)

    for i, (kind, index, tile) in enumerate(tasks):
        if kind == 1:  # MATVEC
            m = matrices[index]
            n, k, x_off, y_off, wait, stage, chunks, strip, blocks = (
                m[1], m[2], m[3], m[4], m[7], m[8], m[11], m[14], m[15])  # fmt: skip
            stride, signal, per_slot = m[16], m[17], m[18]
            rows = step.gated_rows if m[10] >= 0 else step.rows
            first, chunk = (tile // chunks) * strip, tile % chunks
            lo, hi = first * rows, min(n, (first + min(strip, blocks - first)) * rows)
            start = x_off + chunk * step.chunk
            wait_then_read(
                wait + chunk * stride, i, (start, x_off + min(k, (chunk + 1) * step.chunk))
            )
            if signal >= 0:
                for slot in range(lo // per_slot, (hi - 1) // per_slot + 1):
                    counts[signal + slot] += 1
                    written.setdefault(signal + slot, []).append((y_off + lo, y_off + hi))
            counts[1 + stage] += m[19]  # (a signalled stage's count: only when asked)
            if stage == head_stage and counts[1 + stage] == stages[stage]:
                counts[1 + step.scalars[-1]] += 1  # the last head task combines
        elif kind == 2:  # ATTEND
            qkv, _, _, _, _, wait, stage, _ = layers[index]
            head = tile // splits
            kv = head // group
            k_at, v_at = qkv + (w.heads + kv) * hd, qkv + (w.heads + w.kv_heads + kv) * hd
            wait_then_read(wait + kv, i, (qkv + head * hd, qkv + (head + 1) * hd),
                           (k_at, k_at + hd), (v_at, v_at + hd))  # fmt: skip
            counts[1 + stage] += 1
        elif kind == 0:  # EMBED
            counts[1] += 1
        else:  # LOGPROB
            wait_then_read(index, i)
    for counter, need in waits:
        assert counts[counter] == need, f"counter {counter} reaches {counts[counter]}, wait {need}"
    return written


def test_tasks_wait_for_exactly_what_they_read() -> None:
    """The plan's waits (simulated from its tables): attention waits for its kv group's q, k
    and v rows only, the down projection's chunks for their own gated rows, and every wait is
    met by earlier tasks and counts exactly its writers, at one tile a task and in strips, at
    the Llama-3.2-1B shape (its weights allocated, never written) and at tilings whose strips
    straddle groups and chunks."""
    one = torch.zeros(1, dtype=torch.long)
    small = random_weights(64, 4, 2, 16, 192, 300, layers=2, max_len=40, device="cpu",
                           dtype=torch.float32)  # fmt: skip
    for tiling in ({"tile_elements": 256, "programs": 3}, {"tile_elements": 256, "programs": 3,
                   "waves": 1}, {"tile_elements": 64, "programs": 3, "waves": 2},
                   {"tile_elements": 1024, "programs": 5, "waves": 1},
                   {"tile_elements": 256, "programs": 3, "count_signalled_stages": True},
                   {"tile_elements": 256, "programs": 3, "reader_sums": True},
                   {"tile_elements": 64, "programs": 3, "waves": 2, "reader_sums": True},
                   {"tile_elements": 64, "programs": 3, "waves": 2, "small_waves": 1}):  # fmt: skip
        written = simulate_schedule(FusedDecodeStep(small, one, one, **tiling))
        assert len(written) == 2 * (2 + 3), tiling  # a layer: 2 kv groups, 3 chunks of 64
    config = resolve_model_config(ModelConfig(name="llama3", flavor="1B"))
    with torch.device("meta"):
        model = build_model(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    weights = decode_weights(model, model.new_cache(1, 384, "cpu", torch.bfloat16))
    tasks, strips = {}, {}  # each tiling's tasks a matrix and strips (layer 0)
    for tiling in ({"programs": 264}, {"programs": 132, "tile_elements": 16384, "waves": None},
                   {"programs": 264, "waves": 2}, {"programs": 264, "waves": 2, "small_waves": 1},
                   {"programs": 264, "reader_sums": True}):  # fmt: skip
        step = FusedDecodeStep(weights, one, one, **tiling)
        assert len(simulate_schedule(step)) == 16 * (8 + 4)  # a layer: 8 kv groups, 4 chunks
        tasks[str(tiling)] = step.tasks[step.tasks[:, 0] == 1, 1].bincount().tolist()
        strips[str(tiling)] = step.matrices[:6, 14].tolist()
    # The default (one wave): q/k/v's 768 row blocks of 4 rows in 257 strips of 3, o's 512 in
    # 256 of 2, gate/up's 4,096 blocks of 2 gated rows in 256 of 16, down's 512 blocks in 4
    # chunks in 64 strips of 8 a chunk: at most one task a program a stage. Two waves: 384
    # strips of 2 for q/k/v (a second task for 120 of the 264 programs while the rest wait);
    # small_waves 1 sizes the attention's stages as one wave does and keeps the MLP's at two.
    for key, want_tasks, want_strips in (
        ({"programs": 264}, [171, 43, 43, 256, 256, 256], [3, 3, 3, 2, 16, 8]),
        ({"programs": 264, "waves": 2}, [256, 64, 64, 512, 512, 512], [2, 2, 2, 1, 8, 4]),
        ({"programs": 264, "waves": 2, "small_waves": 1}, [171, 43, 43, 256, 512, 512],
         [3, 3, 3, 2, 8, 4]),
    ):  # fmt: skip
        assert (tasks[str(key)][:6], strips[str(key)]) == (want_tasks, want_strips), key
    # reader_sums: the stream after a layer is the down projection's 4 chunk partials and o's
    # output after them; the first layer reads the embedding (one part), every later reader of
    # the stream (q/k/v's input, o's residual, the head's input) sums 5, and no down strip
    # counts its finished chunks.
    rows = step.matrices.tolist()
    assert step.constants()["PARTS"] == 5
    x_parts = [row[20] for row in rows]
    resid_parts = [row[21] for row in rows]
    downs = [row for row in rows if row[16] == 1]  # the chunk-strided waits
    assert len(downs) == 16 and all(row[13] == -1 and row[11] == 4 for row in downs)
    assert x_parts == [1, 1, 1] + [1, 1, 1] + [5, 5, 5, 1, 1, 1] * 15 + [5]
    assert resid_parts == [1, 1, 1, 1, 1, 1] + [1, 1, 1, 5, 1, 1] * 15 + [1]
    for down, o in zip(downs, rows[3::6]):  # o's output sits after the down's partials
        assert o[4] == down[12] + 4 * 2048


def test_prefetch_table_names_the_first_rows_of_each_programs_next_task() -> None:
    """``prefetch``'s table: each task's row names the weights its program's next task
    (round-robin: the task a program count later) reads first, namely the first ``prefetch``
    row blocks of that task's strip (fewer where its strip is shorter) over its slice of the
    input, and the up projection's same rows for a gated task; nothing where the next task is
    no matrix's or there is none. Built here for the CPU's tensors (the kernel runs it on a
    GPU only), at tilings with chunked strips, gated strips shorter than the prefetch and one
    tile a task."""
    small = random_weights(64, 4, 2, 16, 192, 300, layers=2, max_len=40, device="cpu",
                           dtype=torch.float32)  # fmt: skip
    one = torch.zeros(1, dtype=torch.long)
    tensors = FusedDecodeStep._tensors(small)
    base = min(tensors, key=torch.Tensor.data_ptr)

    def locate(at: int) -> tuple[torch.Tensor, int, int]:  # (tensor, row, column) of an offset
        address = base.data_ptr() + at * base.element_size()
        for t in tensors:
            start = t.data_ptr()
            if start <= address < start + t.numel() * t.element_size():
                row, col = divmod((address - start) // t.element_size(), t.shape[-1])
                return t, row, col
        raise AssertionError(f"offset {at} is in no weight")

    checked = 0
    for tiling in ({"tile_elements": 256, "programs": 3, "waves": 1},
                   {"tile_elements": 64, "programs": 5, "waves": 2},
                   {"tile_elements": 256, "programs": 3, "waves": None}):  # fmt: skip
        step = FusedDecodeStep(small, one, one, schedule="dynamic", **tiling)
        tasks, matrices = step.tasks.tolist(), step.matrices.tolist()
        for prefetch in (1, 2, 5):
            step.prefetch = prefetch
            table = step._prefetch_table(tasks, matrices)
            for t in range(len(tasks)):
                at, up_at, rows, stride, width = table[5 * t : 5 * t + 5]
                following = t + step.programs
                if following >= len(tasks) or tasks[following][0] != 1:
                    assert (rows, up_at) == (0, -1), (t, tasks[following : following + 1])
                    continue
                m = matrices[tasks[following][1]]
                tile, chunks, strip, blocks = tasks[following][2], m[11], m[14], m[15]
                per_block = step.rows if m[10] < 0 else step.gated_rows
                first, chunk = (tile // chunks) * strip, tile % chunks
                want_rows = min(m[1], (first + min(strip, blocks - first, prefetch)) * per_block)
                weight, row, col = locate(at)
                assert weight.data_ptr() - base.data_ptr() == m[0] * base.element_size()
                assert (row, col) == (first * per_block, chunk * step.chunk), (t, row, col)
                assert rows == want_rows - first * per_block > 0 and stride == weight.shape[1]
                assert width == min(step.chunk, stride - col)
                if m[10] >= 0:  # gated: the up projection's same rows
                    up, up_row, up_col = locate(up_at)
                    assert up.data_ptr() - base.data_ptr() == m[10] * base.element_size()
                    assert (up_row, up_col) == (row, col)
                else:
                    assert up_at == -1
                checked += 1
    assert checked > 500, checked


def test_kernel_compiles_for_hopper() -> None:
    """The kernel compiles for sm_90 at the Llama-3.2-1B shape in bf16 (what the interpreter
    never checks: one type per value across branches and loops), its default tiling without
    spilling registers (ptxas's report), and it reads weights 16
    bytes a thread at a time: with offsets read from its tables the compiler knows nothing of
    their alignment unless told (it issued one 2-byte load an element before the hints); and a
    strip's blocks are copied into shared memory ahead of use."""
    pytest.importorskip("triton")
    from torchloom.kernels import fused_decode
    from torchloom.kernels.triton_support import compile_for_hopper, compile_sm90

    config = resolve_model_config(ModelConfig(name="llama3", flavor="1B"))
    with torch.device("meta"):
        model = build_model(config)
    cache = model.new_cache(1, 384, "meta", torch.bfloat16)
    position = torch.zeros(1, dtype=torch.long, device="meta")
    # Tasks from the counter (the default on the interpreter; on a GPU they are dealt).
    step = FusedDecodeStep(decode_weights(model.to(torch.bfloat16), cache), position, position,
                           schedule="dynamic")  # fmt: skip
    args = step.sm90_arguments()
    assert args[3] == fused_decode.DEFAULT_WARPS
    usage = compile_for_hopper(*args)
    assert usage.endswith(" SPILLS:0"), usage
    compiled = compile_sm90(*args)
    ptx = compiled.asm["ptx"]
    # Every block of a strip streams through asynchronous copies into shared memory (the loop
    # Triton pipelines), 16 bytes a copy, within what one program may hold; any weight load
    # outside them is 16 bytes a thread too.
    copies = re.findall(r"cp\.async\.cg\.shared\.global\S* \[[^]]*\], \[[^]]*\], (\w+)", ptx)
    assert copies and set(copies) == {"0x10"}, copies
    weight_loads = re.findall(r"ld\.global\.L1::evict_first\S*", ptx)
    assert all(load.endswith(".v4.b32") for load in weight_loads), weight_loads
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
    # Untraced, the trace's stamps compile to nothing; traced, the strip stays pipelined.
    assert "%clock64" not in ptx and "%globaltimer" not in ptx
    traced = FusedDecodeStep(decode_weights(model, cache), position, position, trace=True)
    assert compile_for_hopper(*traced.sm90_arguments()).endswith(" SPILLS:0")
    ptx = compile_sm90(*traced.sm90_arguments()).asm["ptx"]
    assert ptx.count("%clock64") >= 6 and "cp.async.cg.shared.global" in ptx
    # Tasks dealt from the counter: one relaxed atomic to start, one a task. Dealt round-robin
    # (schedule "static"): none, and the strips stay pipelined.
    assert compiled.asm["ptx"].count("atom.global.gpu.relaxed.add") == 2
    # (schedule "static", the default off the interpreter): none, and the strips stay
    # pipelined. The down projection's partials summed by their last chunk, not the readers.
    static = FusedDecodeStep(decode_weights(model, cache), position, position)
    assert static.static and static.parts == 5  # 4 down chunks and o's output
    assert compile_for_hopper(*static.sm90_arguments()).endswith(" SPILLS:0")
    ptx = compile_sm90(*static.sm90_arguments()).asm["ptx"]
    assert "atom.global.gpu.relaxed" not in ptx
    assert ptx.count("cp.async.cg.shared.global") == len(copies)
    chunk_sums = FusedDecodeStep(decode_weights(model, cache), position, position,
                                 reader_sums=False)  # fmt: skip
    assert chunk_sums.parts == 1
    assert compile_for_hopper(*chunk_sums.sm90_arguments()).endswith(" SPILLS:0")
    # prefetch: one L2 request a thread a row block (a [4, 32] tile of 128-byte lines, twice
    # for the gate's and the up projection's), the strips' copies as they were, no spills.
    prefetching = FusedDecodeStep(decode_weights(model, cache), position, position, prefetch=2)
    assert compile_for_hopper(*prefetching.sm90_arguments()).endswith(" SPILLS:0")
    ptx = compile_sm90(*prefetching.sm90_arguments()).asm["ptx"]
    assert ptx.count("prefetch.global.L2 ") == 2 and "prefetch.global.L2" not in compiled.asm["ptx"]
    assert ptx.count("cp.async.cg.shared.global") == len(copies)


def test_stamp_columns_are_the_kernels() -> None:
    """The kernel writes its trace columns as literals (a jit function reads no plain globals),
    each marked with its ``Stamp`` name: every mark's literal is that member's number, and
    every member is written somewhere. (A ``Stamp`` renumbered alone would otherwise pass every
    CPU test and mislabel the trace.)"""
    from torchloom.kernels import fused_decode

    source = Path(fused_decode.__file__).read_text()
    uses = re.findall(r"trace_row(?: \+ (\d+)|, (\d+))?,[^\n]*# Stamp\.(\w+)", source)
    assert len(uses) >= len(fused_decode.Stamp), uses
    for plus, field, name in uses:
        assert int(plus or field or 0) == fused_decode.Stamp[name], (name, plus or field or 0)
    assert {name for *_, name in uses} == set(fused_decode.Stamp.__members__)
    assert max(fused_decode.Stamp) < fused_decode.TRACE_FIELDS


def test_widths_not_multiples_of_16_are_refused() -> None:
    """The kernel loads rows 16 elements at a time: a model whose widths are not multiples of 16
    is refused in one line, by the generator's check and by the plan itself."""
    odd = tiny(ffn_dim=200)
    problem = fused_step_problem(odd, odd.new_cache(1, 8, "cpu", torch.float32))
    assert problem is not None and "multiple of 16" in problem, problem
    weights = random_weights(64, 4, 2, 16, 200, 50, layers=1, max_len=8, device="cpu",
                             dtype=torch.float32)  # fmt: skip
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="16 elements at a time.*MLP width 200"):
        FusedDecodeStep(weights, one, one)


def test_kernel_in_the_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_kernel_matches_the_reference_on_gpu() -> None:
    """bf16 at the Llama-3.2-1B layer shapes (2 of its 16 layers, its 128,256-token head) at
    positions 0, 300 and the cache's last, at the default tiling (strips of row blocks, one
    task a program a stage; the wait inside the strip loop, and before it) and at two and three
    waves, and at one tile a task; the generator from CUDA graphs, eager and compiled."""
    weights = random_weights(2048, 32, 8, 64, 8192, 128256, layers=2, max_len=512,
                             device="cuda", dtype=torch.bfloat16)  # fmt: skip
    wide = {"tile_elements": 16384, "num_warps": 8, "programs_per_sm": 1}
    one = torch.zeros(1, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="needs every program resident at once"):
        FusedDecodeStep(weights, one, one, schedule="static", programs_per_sm=3)  # 12 warps
    lines = [
        # strips, one task a program a stage, dealt round-robin, the readers summing the down
        # projection's partials
        check_kernel(weights, [0, 300, 511], 2e-2),
        check_kernel(weights, [0, 300, 511], 2e-2, waves=2),  # the default before s46
        check_kernel(weights, [0, 300, 511], 2e-2, strip_tops=False),  # the combine before s47
        check_kernel(with_a_tie(weights, 300), [300], 2e-2),
        check_kernel(with_a_tie(weights, 300), [300], 2e-2, strip_tops=False),
        check_kernel(weights, [511], 2e-2, splits=16, block_l=32),
        check_kernel(weights, [300], 2e-2, waves=1, **wide),
        check_kernel(weights, [300], 2e-2, waves=3, tile_elements=8192, num_warps=4),
        check_kernel(weights, [0, 300], 2e-2, wait_in_loop=False),  # the first block alone
        check_kernel(weights, [300], 2e-2, count_signalled_stages=True),
        check_kernel(weights, [0, 300], 2e-2, trace=True),  # the stamps change no result
        check_kernel(weights, [0, 300, 511], 2e-2, schedule="dynamic"),  # from the counter
        check_kernel(weights, [300], 2e-2, waves=3, programs_per_sm=1),
        check_kernel(weights, [0, 300, 511], 2e-2, waves=2, small_waves=1),  # attention's: 1
        check_kernel(weights, [0, 300, 511], 2e-2, reader_sums=False),  # the last chunk sums
        check_kernel(weights, [0, 300, 511], 2e-2, prefetch=2),  # next tasks' weights to L2
        check_kernel(weights, [300], 2e-2, prefetch=16, waves=2),
        check_kernel(weights, [300], 2e-2, reader_sums=False, schedule="dynamic"),
        check_kernel(weights, [0, 300], 2e-2, waves=None, **wide),  # one tile a task
        check_kernel(weights, [300], 2e-2, waves=None, **wide | {"tile_elements": 32768}),
        check_generator("cuda"),
        check_generator("cuda", compile=True),
        check_generator("cuda", compile=True, fused="auto"),
        check_generator("cuda", fused="default"),
    ]
    print("\n".join(lines))


@pytest.mark.gpu
def test_prefetch_changes_no_bit_on_gpu() -> None:
    """Asking L2 for the next tasks' weights is a hint: the step's log-probabilities, token and
    cache are bitwise those of the step without it (bf16, the 1B layer shapes, 2 layers)."""
    weights = random_weights(2048, 32, 8, 64, 8192, 128256, layers=2, max_len=512,
                             device="cuda", dtype=torch.bfloat16)  # fmt: skip
    results = []
    for prefetch in (0, 1, 4):
        mine = copy.deepcopy(weights)
        token_1 = torch.tensor([7], device="cuda")
        position_1 = torch.tensor([300], device="cuda")
        logprobs_1V, best_21 = FusedDecodeStep(mine, token_1, position_1, prefetch=prefetch)()
        results.append((logprobs_1V.clone(), best_21.clone(), token_1.clone(),
                        [layer.k_cache.clone() for layer in mine.layers]))  # fmt: skip
    for other in results[1:]:
        for a, b in zip(results[0][:3], other[:3]):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(results[0][3], other[3]))


@pytest.mark.gpu
def test_traced_stamps_are_in_order_on_gpu() -> None:
    """A traced step (bf16, the 1B layer shapes, 2 layers) stamps every task: each matrix
    task's start, wait, input, strip and end in that order on one multiprocessor, within the
    step's span on the global timer."""
    from torchloom.kernels.fused_decode import TRACE_FIELDS, Stamp

    weights = random_weights(2048, 32, 8, 64, 8192, 128256, layers=2, max_len=512,
                             device="cuda", dtype=torch.bfloat16)  # fmt: skip
    token_1 = torch.tensor([7], device="cuda")
    position_1 = torch.tensor([300], device="cuda")
    step = FusedDecodeStep(weights, token_1, position_1, trace=True)
    step()
    stamps = step.stamps.view(-1, TRACE_FIELDS).cpu()
    matrix = step.tasks[:, 0].cpu() == 1
    columns = (Stamp.START, Stamp.WAIT, Stamp.WAITED, Stamp.INPUT, Stamp.STRIP, Stamp.END)
    start, wait, waited, got_input, strip, end = (stamps[matrix, i] for i in columns)
    for earlier, later in ((start, wait), (wait, waited), (waited, got_input),
                           (got_input, strip), (strip, end)):  # fmt: skip
        assert bool((later >= earlier).all())
    assert bool((stamps[:, Stamp.END_NS] >= stamps[:, Stamp.START_NS]).all())
    assert bool((stamps[:, Stamp.START_NS] > 0).all())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert int(stamps[:, Stamp.SM].max()) < sms


if __name__ == "__main__":  # run by test_kernel_in_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    print(f"Triton interpreter checks ({Path(__file__).name}):")
    small = random_weights(64, 4, 2, 16, 192, 300, layers=2, max_len=40, device="cpu",
                           dtype=torch.float32)  # fmt: skip
    strips = {"tile_elements": 256, "block_l": 8, "programs": 3, "waves": 1}
    for line in (
        # 4 query heads on 2 kv heads; FFN 192 padded to 256; keys in blocks of 8, 4 splits:
        # at 39 each split holds two blocks (the first loaded early), at 5 split 0 alone
        # (one tile a task: waves None)
        check_kernel(small, [0, 5, 39], 1e-5, tile_elements=256, block_l=8, programs=3, waves=None),
        check_kernel(
            small, [17], 1e-5, tile_elements=64, block_l=64, splits=1, programs=1, waves=None
        ),
        check_kernel(
            small, [39], 1e-5, tile_elements=1024, block_l=4, splits=8, programs=2, waves=None
        ),
        # strips: 3 programs, one wave (q/k/v's 32 row blocks in strips of 11, the down
        # projection's 3 chunks of 16 blocks whole) and two (one row a block: strips of 22 over
        # q's 64 and k's 32, the head's 300 in 6)
        check_kernel(small, [0, 39], 1e-5, **strips),
        check_kernel(small, [21], 1e-5, tile_elements=64, block_l=8, programs=3, waves=2),
        # q/k/v and o at one wave (strips of 43 and 22 rows) while the MLP's stages take two
        check_kernel(
            small, [21], 1e-5, tile_elements=64, block_l=8, programs=3, waves=2, small_waves=1
        ),
        # each head strip combining its blocks' (max, sum, argmax) first (the default since
        # s47): one wave (3 strips of 25 blocks of 4 rows), two (6 of 50 one-row blocks), one
        # tile a task; the combine before s47 (the last task reads every block's triple); and
        # the argmax row repeated in another strip, where the lower row wins with either
        check_kernel(small, [0, 39], 1e-5, **strips, strip_tops=True),
        check_kernel(small, [21], 1e-5, tile_elements=64, programs=3, waves=2, strip_tops=True),
        check_kernel(small, [5], 1e-5, tile_elements=256, programs=3, waves=None, strip_tops=True),
        check_kernel(small, [0, 39], 1e-5, **strips, strip_tops=False),
        check_kernel(with_a_tie(small, 21), [21], 1e-5, **strips, strip_tops=True),
        check_kernel(with_a_tie(small, 21), [21], 1e-5, **strips, strip_tops=False),
        # the first block loaded alone before the wait, the loop from the second
        check_kernel(small, [0, 39], 1e-5, **strips, wait_in_loop=False),
        # every task also counted in its stage (q/k/v and gate/up: read by no wait)
        check_kernel(small, [21], 1e-5, tile_elements=256, programs=3, count_signalled_stages=True),
        # dealt round-robin: one program here (the interpreter runs programs one by one)
        check_kernel(small, [21], 1e-5, tile_elements=256, programs=1, schedule="static"),
        # the down projection's 3 chunk partials summed by their last chunk, not the readers
        check_kernel(small, [0, 39], 1e-5, **strips, reader_sums=False),
        check_kernel(small, [5], 1e-5, tile_elements=64, programs=3, waves=None, reader_sums=False),
        check_generator("cpu"),
    ):
        print(line)
    try:  # the trace reads the GPU's clocks in inline PTX, which the interpreter does not run
        FusedDecodeStep(small, torch.zeros(1, dtype=torch.long),
                        torch.zeros(1, dtype=torch.long), trace=True)  # fmt: skip
        raise AssertionError("trace=True ran under the interpreter")
    except ValueError as error:
        assert "interpreter" in str(error), error
        print("trace=True refused under the interpreter")
    one = torch.zeros(1, dtype=torch.long)
    try:  # round-robin programs wait for one another: the interpreter would spin forever
        FusedDecodeStep(small, one, one, programs=3, schedule="static")()
        raise AssertionError("a static schedule of 3 programs ran under the interpreter")
    except ValueError as error:
        assert "one after another" in str(error), error
        print("a static schedule of several programs refused under the interpreter")
