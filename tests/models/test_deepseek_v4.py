"""DeepSeek-V4 <-> transformers' DeepseekV4ForCausalLM: logits of random checkpoints for every
attention kind (sliding window, compressed sparse with the indexer's picks, heavily compressed)
with hash-routed and top-k MoE layers, exports transformers loads, DeepSeek's published tensor
names, the published flavors' parameter counts, config refusals; and the components' own
properties (Sinkhorn, visibility of compressed groups, hash routing)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import torchloom
from torchloom.checkpoint.hf import save_hf
from torchloom.cli import resolve_job
from torchloom.config.errors import ConfigError
from torchloom.kernels.sinkhorn import sinkhorn
from torchloom.models import build_model
from torchloom.models.components.compressed_attention import CSA, HCA, SLIDING
from torchloom.models.components.hyper_connections import HyperConnection, HyperHead
from torchloom.models.components.moe import MoE, MoEConfig
from torchloom.models.components.param_init import ParamInit
from torchloom.models.deepseek_v4 import DEEPSEEK_V4_FLAVORS, DeepSeekV4, DeepSeekV4HFAdapter
from torchloom.train.loss import cross_entropy_sum
from torchloom.train.trainer import Trainer

ADAPTER = DeepSeekV4HFAdapter()
VOCAB, EXPERTS, TOP_K = 512, 8, 2
# Groups of 4 (CSA, the indexer picking 3) and 16 (HCA), a window of 16: with 70 tokens every
# path acts (17 groups of 4 against 3 picks, 4 groups of 16, keys outside the window). 8 index
# heads keep exactly tied index scores rare (see test_export_loads_in_transformers).
V4_TINY = dict(
    vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
    head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25, n_routed_experts=EXPERTS,
    num_experts_per_tok=TOP_K, o_groups=2, o_lora_rank=16, sliding_window=16,
    compress_rates={CSA: 4, HCA: 16}, index_n_heads=8, index_head_dim=16, index_topk=3,
    max_position_embeddings=256,
)  # fmt: skip
SCHEDULES = {
    "sliding": [SLIDING, SLIDING],
    "csa": [CSA, CSA],
    "hca": [HCA, HCA],
    "mixed": [SLIDING, CSA, HCA, CSA],
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1}  # fmt: skip


def hf_v4(tmp_path, kinds: list[str], seed: int = 0, **config) -> tuple:
    """A random transformers DeepSeek-V4 (the first layer hash-routed, the hash table random),
    saved under tmp_path/hf: (folder, model in eval mode)."""
    transformers.utils.logging.disable_progress_bar()
    mlp_kinds = ["hash_moe"] + ["moe"] * (len(kinds) - 1)
    hf_config = transformers.DeepseekV4Config(
        **(V4_TINY | config), num_hidden_layers=len(kinds), layer_types=kinds,
        mlp_layer_types=mlp_kinds, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.DeepseekV4ForCausalLM(hf_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
            if name.endswith("tid2eid"):  # a real table: distinct experts per token
                rows = [torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in buffer]
                buffer.copy_(torch.stack(rows))
    path = tmp_path / "hf"
    model.save_pretrained(path)
    return path, model.eval()


def tokens(length: int = 70) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@torch.no_grad()
def test_from_hf_logits_match_transformers(schedule, tmp_path, logits_parity) -> None:
    path, reference = hf_v4(tmp_path, SCHEDULES[schedule])
    model = torchloom.from_hf(path)
    assert isinstance(model, DeepSeekV4)
    assert model.config.kinds() == tuple(SCHEDULES[schedule])
    hash_table = model.layers["0"].mlp.router.tid2eid
    assert torch.equal(hash_table, reference.model.layers[0].mlp.gate.tid2eid)
    window = tokens()
    logits_parity(f"deepseek_v4 {schedule}", model(window), reference(window).logits)


@torch.no_grad()
def test_compressed_layers_with_yarn_match_transformers(tmp_path, logits_parity) -> None:
    """The compressed layers' YaRN RoPE (cos/sin unscaled, as the published checkpoints)."""
    path, reference = hf_v4(tmp_path, [SLIDING, CSA, HCA], rope_parameters=YARN)
    model = torchloom.from_hf(path)
    assert model.config.compress_rope.scaling == "yarn" and model.config.rope.scaling == "none"
    window = tokens()
    logits_parity("deepseek_v4 yarn", model(window), reference(window).logits)


def test_training_step_matches_transformers(tmp_path) -> None:
    """Loss and gradients through every kind (the indexer's too: its picks choose what the loss
    sees, though the top-k itself passes no gradient), the mixings and the hash-routed MoE."""
    path, reference = hf_v4(tmp_path, [SLIDING, CSA, HCA])
    model = torchloom.from_hf(path).train()
    reference.train()
    window = tokens(71)
    loss = cross_entropy_sum(model(window[:, :-1]), window[:, 1:]) / window[:, 1:].numel()
    loss.backward()
    hf_loss = reference(input_ids=window, labels=window).loss
    hf_loss.backward()
    print(f"loss: ours {loss.item():.6f}, transformers {hf_loss.item():.6f}")
    torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=0)
    ours, theirs = model.layers, reference.model.layers
    pairs = {
        "hc fn": (ours["1"].attention_hc.fn, theirs[1].attn_hc.fn),
        "sinks": (ours["2"].attention.sinks, theirs[2].self_attn.sinks),
        "csa compressor": (ours["1"].attention.compressor.gate_proj.weight,
                           theirs[1].self_attn.compressor.gate_proj.weight),
        "hca slots": (ours["2"].attention.compressor.position_bias,
                      theirs[2].self_attn.compressor.position_bias),
        "indexer q": (ours["1"].attention.indexer.q_b_proj.weight,
                      theirs[1].self_attn.compressor.indexer.q_b_proj.weight),
        "hash router": (ours["0"].mlp.router.weight, theirs[0].mlp.gate.weight),
        "o_a_proj": (ours["0"].attention.o_a_proj.weight, theirs[0].self_attn.o_a_proj.weight),
        "hc_head": (model.hc_head.hc_fn, reference.model.hc_head.hc_fn),
    }  # fmt: skip
    for name, (mine, hf) in pairs.items():
        if hf.grad is None:
            assert mine.grad is None or not mine.grad.any(), name
            print(f"  grad {name}: none in either")
            continue
        diff = (mine.grad - hf.grad).abs().max().item()
        print(f"  grad {name}: max abs diff {diff:.2e} (max {hf.grad.abs().max().item():.2e})")
        torch.testing.assert_close(mine.grad, hf.grad, rtol=1e-4, atol=1e-6)


def test_indexer_loss_trains_the_indexer_only() -> None:
    """With indexer_loss_weight the CSA layer reports ``indexer`` (a KL, >= 0) and its indexer
    gets gradients; every other parameter's gradient is what it is without the loss."""
    grads = {}
    for weight in (0.0, 0.5):
        cfg = replace(DEEPSEEK_V4_FLAVORS["debug"], indexer_loss_weight=weight)
        model = build_model(cfg).train()
        model.init_weights(0)
        window = tokens(65) % 4096
        loss = cross_entropy_sum(model(window[:, :-1]), window[:, 1:]) / window[:, 1:].numel()
        terms = model.auxiliary_losses()
        assert ("indexer" in terms) == bool(weight)
        if weight:
            print(f"indexer loss {terms['indexer'].item():.4f}")
            assert terms["indexer"].item() > 0
            loss = loss + terms["indexer"]
        loss.backward()
        grads[weight] = {n: p.grad for n, p in model.named_parameters()}
    indexer = "layers.1.attention.indexer."
    assert grads[0.0][indexer + "q_b_proj.weight"] is None
    assert grads[0.5][indexer + "q_b_proj.weight"].abs().max() > 0
    for name, grad in grads[0.0].items():
        if grad is not None:
            torch.testing.assert_close(grads[0.5][name], grad, rtol=0, atol=0)


@torch.no_grad()
def test_packed_documents_do_not_see_each_other(tmp_path) -> None:
    """With document ids, a token's logits do not change when another document's tokens do:
    the window is same-document and a compressed group is visible only whole in the query's
    document."""
    path, _ = hf_v4(tmp_path, [SLIDING, CSA, HCA])
    model = torchloom.from_hf(path)
    window = tokens()[:1]
    doc_ids = (torch.arange(70) >= 29).long()[None]  # documents of 29 and 41 tokens
    positions = torch.cat([torch.arange(29), torch.arange(41)])[None]
    other = window.clone()
    other[0, :29] = (other[0, :29] + 1) % VOCAB
    a = model(window, positions, doc_ids)
    b = model(other, positions, doc_ids)
    diff = (a[0, 29:] - b[0, 29:]).abs().max().item()
    changed = (a[0, :29] - b[0, :29]).abs().max().item()
    print(f"first document's logits change by {changed:.1e}, the second's by {diff:.1e}")
    # Not bitwise: other tokens change how many rows each expert's matmul gets (rounding only).
    assert changed > 0.1 and diff < 1e-5


@torch.no_grad()
def test_indexer_picks_matter(tmp_path) -> None:
    """The sparse path really acts: other picks (a perturbed indexer) change the logits."""
    path, _ = hf_v4(tmp_path, [CSA])
    model = torchloom.from_hf(path)
    window = tokens()
    before = model(window)
    model.layers["0"].attention.indexer.kv_proj.weight.add_(0.5)
    diff = (model(window) - before).abs().max().item()
    print(f"logit change from a perturbed indexer: {diff:.2e}")
    assert diff > 1e-3


@torch.no_grad()
def test_export_loads_in_transformers(tmp_path, logits_parity) -> None:
    # 8 index heads: exactly tied index scores (every head's relu 0), which torchloom breaks
    # towards earlier groups and transformers' topk arbitrarily, stay rare.
    cfg = replace(DEEPSEEK_V4_FLAVORS["debug"], vocab_size=VOCAB, index_heads=8)
    model = build_model(cfg)
    model.init_weights(0)
    generator = torch.Generator().manual_seed(2)
    for param in model.parameters():  # every weight matters (sinks, biases, mixes)
        param.add_(0.05 * torch.randn(param.shape, generator=generator))
    rows = [torch.randperm(8, generator=generator)[: cfg.moe.top_k] for _ in range(VOCAB)]
    model.layers["0"].mlp.router.tid2eid.copy_(torch.stack(rows))
    save_hf(tmp_path / "out", "deepseek_v4", cfg, model.state_dict().items())
    reference = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    window = tokens(60)
    logits_parity("deepseek_v4 export", model(window), reference(window).logits, rel=1e-5)
    again = torchloom.from_hf(tmp_path / "out")
    assert torch.equal(again(window), model(window))


@torch.no_grad()
def test_published_tensor_names_load(tmp_path, logits_parity) -> None:
    """DeepSeek's published folders: no "model." prefix; embed, norm and hc_head_* at the top;
    the attention's key/value norm as attn.kv_norm (transformers saves attn.norm); an MTP layer
    (skipped, as transformers skips it)."""
    path, reference = hf_v4(tmp_path, [SLIDING, HCA])
    tensors = load_file(path / "model.safetensors")
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}  # fmt: skip
    published = {top.get(k, k.removeprefix("model.")): v for k, v in tensors.items()}
    published = {k.replace(".attn.norm.", ".attn.kv_norm."): v for k, v in published.items()}
    assert sum(".attn.kv_norm." in k for k in published) == 2
    published["mtp.0.hc_head_fn"] = torch.zeros(2)
    (path / "model.safetensors").unlink()
    save_file(published, path / "model.safetensors")
    model = torchloom.from_hf(path)
    window = tokens()
    logits_parity("deepseek_v4 published names", model(window), reference(window).logits)


def test_convert_both_ways(tmp_path, convert_round_trip) -> None:
    """`torchloom convert` from transformers' folder and back: every tensor (the int64 hash
    table too) comes back bitwise under the same name."""
    path, _ = hf_v4(tmp_path, [SLIDING, CSA, HCA])
    original, back = convert_round_trip(path)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_initial_load_hf_trains_from_its_loss(tmp_path) -> None:
    """`--checkpoint.initial_load_hf` on a transformers DeepSeek-V4 folder: the first training
    loss is transformers' on the same batch, and training runs."""
    path, reference = hf_v4(tmp_path, [SLIDING, CSA, HCA], vocab_size=4100)
    args = ["--recipe", "deepseek_v4_debug", "--checkpoint.initial_load_hf", str(path),
            "--training.steps", "2", "--training.sample_tokens", "0", "--training.seq_len", "64",
            "--training.val_sequences", "4", "--metrics.tensorboard", "false",
            "--data.document_mask", "false", "--output.dir", str(tmp_path / "run")]  # fmt: skip
    _, job = resolve_job(args)
    trainer = Trainer(job)
    state = trainer.train_loader.state_dict()
    (batch,) = trainer.train_loader.next_step()
    trainer.train_loader.load_state_dict(state)
    result = trainer.train()
    with torch.no_grad():
        hf_loss = reference(input_ids=batch.tokens, labels=batch.labels, shift_labels=batch.labels)
    print(f"first loss: trainer {result.first_loss:.6f}, transformers {hf_loss.loss.item():.6f}")
    assert abs(result.first_loss - hf_loss.loss.item()) < 1e-5 and result.steps == 2


def test_published_flavors_match_transformers_parameter_counts() -> None:
    for name, billions, active in (("flash", 284, 13), ("pro", 1573, 49)):
        cfg = DEEPSEEK_V4_FLAVORS[name]
        # The published counts and transformers' model leave out the MTP depth both flavors have.
        main = replace(cfg, mtp_layers=0)
        hf = ADAPTER.config_to_hf(cfg)
        with torch.device("meta"):
            reference = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**hf))
        theirs = sum(p.numel() for p in reference.parameters())
        print(f"{name}: ours {main.num_params():,} (with MTP {cfg.num_params():,}), "
              f"transformers {theirs:,}")  # fmt: skip
        assert cfg.mtp_layers == 1 and main.num_params() == theirs
        assert round(theirs / 1e9) == billions
        assert round(main.flops_per_token(0) / 6e9) == active  # the published 13B / 49B active
        assert ADAPTER.config_from_hf(hf).kinds() == cfg.kinds()


# deepseek-ai/DeepSeek-V4-Pro's config.json (as published, less its quantization_config).
PRO_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "bos_token_id": 0,
    "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512,
    "hidden_act": "silu", "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64,
    "index_topk": 512, "initializer_range": 0.02, "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4", "moe_intermediate_size": 3072, "n_routed_experts": 384,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 6, "num_hidden_layers": 61, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 16, "o_lora_rank": 1024,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                     "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sqrtsoftplus",
    "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": False,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 129280, "compress_rope_theta": 160000.0,
}  # fmt: skip


def test_published_pro_config_reads_as_the_pro_flavor() -> None:
    assert ADAPTER.config_from_hf(PRO_CONFIG) == DEEPSEEK_V4_FLAVORS["pro"]
    fp8 = PRO_CONFIG | {"quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(ConfigError, match="dequantize the checkpoint to bfloat16 first"):
        ADAPTER.config_from_hf(fp8)


def test_config_refusals() -> None:
    hf = ADAPTER.config_to_hf(DEEPSEEK_V4_FLAVORS["debug"])
    with pytest.raises(ConfigError, match="unknown option use_magic=True"):
        ADAPTER.config_from_hf(hf | {"use_magic": True})
    with pytest.raises(ConfigError, match="scoring_func='softmax' is not supported"):
        ADAPTER.config_from_hf(hf | {"scoring_func": "softmax"})
    with pytest.raises(ConfigError, match="intermediate_size=99 and moe_intermediate_size=32"):
        ADAPTER.config_from_hf(hf | {"intermediate_size": 99})
    with pytest.raises(ConfigError, match="architectures \\['DeepseekV4Model'\\] is not supported"):
        ADAPTER.config_from_hf(hf | {"architectures": ["DeepseekV4Model"]})
    with pytest.raises(ConfigError, match="no batch-invariant attention yet"):
        replace(DEEPSEEK_V4_FLAVORS["debug"], batch_invariant=True).validate()
    with pytest.raises(ConfigError, match="hash-routed layers must come first"):
        ADAPTER.config_from_hf(hf | {"mlp_layer_types": ["moe", "hash_moe", "moe"]})
    debug = DEEPSEEK_V4_FLAVORS["debug"]  # all but the bias update rate, a training setting
    expected = replace(debug, moe=replace(debug.moe, bias_update_rate=0.0))
    assert ADAPTER.config_from_hf(json.loads(json.dumps(hf))) == expected


@pytest.mark.parametrize("leading", [False, True])
@torch.no_grad()
def test_prefill_then_decode_equals_the_full_forward(leading: bool) -> None:
    """Two sequences in slots 2 and 0 (``leading``: 0 and 1, decoded as the CUDA-graph path
    binds them, every index read through the mask) of a cache whose slots hold another
    sequence's state: a 37-token prefill then one token at a time gives the full forward's
    logits (the compressor's partial groups, the indexer's overlap and picks, the window)."""
    model = build_model(DEEPSEEK_V4_FLAVORS["debug"])
    model.init_weights(0)
    generator = torch.Generator().manual_seed(3)
    for param in model.parameters():
        param.add_(0.05 * torch.randn(param.shape, generator=generator))
    model.eval()
    window = torch.randint(0, 4096, (2, 60), generator=generator)
    full = model(window)
    cache = model.new_cache(3, 80, torch.device("cpu"), torch.float32)
    stale = torch.arange(60).expand(3, 60)  # another sequence's state in every slot first
    model(torch.randint(0, 4096, (3, 60), generator=generator), stale,
          cache=cache.bind(torch.arange(3), stale))  # fmt: skip
    slots, prefill = torch.tensor([0, 1] if leading else [2, 0]), 37
    positions = torch.arange(prefill).expand(2, prefill)
    steps = [model(window[:, :prefill], positions, cache=cache.bind(slots, positions))]
    for t in range(prefill, 60):
        positions = torch.full((2, 1), t)
        bound = cache.bind_leading(positions) if leading else cache.bind(slots, positions)
        steps.append(model(window[:, t : t + 1], positions, cache=bound))
    diff = (torch.cat(steps, dim=1) - full).abs().max().item()
    print(f"prefill + decode vs full forward: max abs logit diff {diff:.1e}")
    assert diff < 1e-5


def _perturbed_debug_model() -> tuple[DeepSeekV4, torch.Generator]:
    """The debug flavor (CSA groups of 4, HCA of 16, window 16) with weights off their init."""
    model = build_model(DEEPSEEK_V4_FLAVORS["debug"])
    model.init_weights(0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model.eval(), generator


@pytest.mark.parametrize("chunks", [(7,), (5, 6), (1, 3, 17)])
@torch.no_grad()
def test_chunked_prefill_then_decode_equals_the_full_forward(chunks: tuple[int, ...]) -> None:
    """Prefill in chunks of odd lengths that cross group boundaries (continuing the slot's
    sequence), then decode to 44 tokens (past two HCA groups and the window)."""
    model, generator = _perturbed_debug_model()
    window = torch.randint(0, 4096, (1, 44), generator=generator)
    full = model(window)
    cache = model.new_cache(2, 48, torch.device("cpu"), torch.float32)
    slot, steps, start = torch.tensor([1]), [], 0
    for size in [*chunks, *[1] * (44 - sum(chunks))]:
        positions = torch.arange(start, start + size)[None]
        steps.append(model(window[:, start : start + size], positions, cache=cache.bind(slot, positions)))  # fmt: skip
        start += size
    diff = (torch.cat(steps, dim=1) - full).abs().max().item()
    print(f"chunks {chunks} + decode vs full forward: max abs logit diff {diff:.1e}")
    assert diff < 1e-5


@torch.no_grad()
def test_rows_of_different_lengths_prefill_and_decode_together() -> None:
    """One right-padded prefill of rows of 5 and 23 tokens (``lengths_B``), then decode steps
    where each row is at its own position: each row's logits are its own full forward's."""
    model, generator = _perturbed_debug_model()
    tokens = torch.randint(0, 4096, (2, 40), generator=generator)
    full = model(tokens)
    cache = model.new_cache(3, 48, torch.device("cpu"), torch.float32)
    slots, lengths = torch.tensor([2, 0]), torch.tensor([5, 23])
    positions = torch.arange(23).expand(2, 23)
    prompt = torch.where(positions < lengths[:, None], tokens[:, :23], 0)
    out = model(prompt, positions, cache=cache.bind(slots, positions, lengths))
    diffs = [(out[b, : lengths[b]] - full[b, : lengths[b]]).abs().max().item() for b in range(2)]
    for step in range(17):
        positions = (lengths + step)[:, None]
        out = model(tokens.gather(1, positions), positions, cache=cache.bind(slots, positions))
        diffs += [(out[b, 0] - full[b, positions[b, 0]]).abs().max().item() for b in range(2)]
    print(f"rows of different lengths vs their full forwards: max abs logit diff {max(diffs):.1e}")
    assert max(diffs) < 1e-5


def test_generation_state_is_bounded_by_the_window_and_the_groups() -> None:
    """Token keys take [slots, window, d] whatever max_len is; groups [slots, max_len // ratio,
    d]; the pending projections at most two groups' tokens."""
    model, _ = _perturbed_debug_model()
    config = model.config
    cache = model.new_cache(3, 256, torch.device("cpu"), torch.float32)
    for index, kind in enumerate(config.attention_kinds):
        state = cache.states[index]
        assert state.keys.shape == (3, config.sliding_window, config.head_dim)
        ratio = {SLIDING: None, CSA: config.csa_ratio, HCA: config.hca_ratio}[kind]
        assert len(state.groups) == {SLIDING: 0, CSA: 2, HCA: 1}[kind]
        for groups, partial in zip(state.groups, state.partial, strict=True):
            assert groups.shape[:2] == (3, 256 // ratio)
            assert partial.shape[1] == (2 * ratio if kind == CSA else ratio)


def test_generate_matches_transformers_greedy(tmp_path, generate_matches_greedy) -> None:
    path, reference = hf_v4(tmp_path, [SLIDING, CSA, HCA])
    generate_matches_greedy(path, reference, max_new_tokens=12)


def test_sinkhorn_is_doubly_stochastic_in_fp32() -> None:
    """Columns sum to one after the last (column) step; rows nearly, after 20 iterations."""
    logits = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(0)).bfloat16()
    comb = sinkhorn(logits, iterations=20, eps=1e-6)
    assert comb.dtype == torch.float32 and (comb > 0).all()
    for dim, tolerance in ((-2, 1e-5), (-1, 1e-3)):
        err = (comb.sum(dim) - 1).abs().max().item()
        print(f"sum over dim {dim}: max error {err:.1e}")
        assert err < tolerance


def test_hyper_connections_stay_fp32_under_bf16_autocast() -> None:
    """The trainer's bf16 autocast would run the mixings' linear and the stream mixing in bf16
    (rounding the fp32 residual streams at every join: 1e-2 here): they opt out, so they are
    bitwise the fp32 results."""
    hc, head = HyperConnection(64, 4), HyperHead(64, 4)
    init = ParamInit(torch.nn.ModuleList([hc, head]), 0)
    hc.init_weights(init)
    head.init_weights(init)
    generator = torch.Generator().manual_seed(0)
    streams = torch.randn(2, 8, 4, 64, generator=generator)
    branch = torch.randn(2, 8, 64, generator=generator).bfloat16()

    def run() -> list[torch.Tensor]:
        post, comb, x = hc(streams)
        joined = HyperConnection.join(streams, branch, post, comb)
        return [post, comb, x, joined, head(joined)]

    fp32 = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = run()
    diffs = [(a - b).abs().max().item() for a, b in zip(fp32, autocast, strict=True)]
    print(f"max differences (post, comb, x, joined, head): {diffs}")
    assert all(a.dtype == b.dtype for a, b in zip(fp32, autocast, strict=True))
    assert diffs == [0.0] * 5


def test_hash_routing_uses_the_table() -> None:
    cfg = MoEConfig(num_experts=4, top_k=2, expert_dim=8, num_shared_experts=1,
                    score_func="sqrtsoftplus", normalize_top_k=True, hash_routing=True)  # fmt: skip
    moe = MoE(16, cfg, vocab_size=10)
    moe.init_weights(ParamInit(moe, 0))
    table = moe.router.tid2eid
    assert sorted(set(table.flatten().tolist())) == [0, 1, 2, 3]  # balanced default table
    _, experts, _ = moe.router(torch.randn(3, 16), torch.tensor([7, 7, 2]))
    assert torch.equal(experts, table[torch.tensor([7, 7, 2])])
    with pytest.raises(ValueError, match="needs the token ids"):
        moe(torch.randn(1, 3, 16))


def test_hyper_connection_matches_transformers_where_sinkhorn_has_not_converged() -> None:
    """The mixing module against DeepseekV4HyperConnection with sharp comb logits, where 20
    Sinkhorn iterations have not converged: one iteration fewer moves comb by more than 1e-3,
    so the count and the order of the normalisations are what is tested, not just the limit."""
    hf_config = transformers.DeepseekV4Config(**V4_TINY, hc_mult=4, hc_sinkhorn_iters=20)
    theirs = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4HyperConnection(
        hf_config
    )
    ours = HyperConnection(64, 4, sinkhorn_iters=20, eps=hf_config.hc_eps,
                           norm_eps=hf_config.rms_norm_eps)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.fn.copy_(torch.randn(theirs.fn.shape, generator=generator))
        theirs.base.copy_(torch.randn(theirs.base.shape, generator=generator))
        theirs.scale.copy_(torch.tensor([1.0, 1.0, 4.0]))
    ours.load_state_dict(theirs.state_dict())
    streams = torch.randn(2, 5, 4, 64, generator=generator)
    post, comb, collapsed = ours(streams)
    ref_post, ref_comb, ref_collapsed = theirs(streams)
    # 1e-5: ours scales the linear's output by the norm instead of its input (the same value
    # in exact arithmetic; fp32 rounding moves the sharp comb by ~1e-6), still two orders of
    # magnitude below what one Sinkhorn iteration more or less moves it.
    for got, want in ((post, ref_post), (comb, ref_comb), (collapsed, ref_collapsed)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fewer = HyperConnection(64, 4, sinkhorn_iters=19, eps=hf_config.hc_eps,
                            norm_eps=hf_config.rms_norm_eps)  # fmt: skip
    fewer.load_state_dict(theirs.state_dict())
    moved = (fewer(streams)[1] - ref_comb).abs().max().item()
    print(f"comb moves {moved:.1e} with 19 iterations instead of 20")
    assert moved > 1e-3


@pytest.mark.parametrize("docs", [False, True])
def test_sparse_attention_paths_match_the_dense_reference(docs: bool) -> None:
    """The debug flavor (sliding, CSA, HCA layers) with sparse_attention "gather" (each query's
    window and groups gathered: kernels/sparse_attention.py) gives the dense reference's logits
    and gradients, with and without packed documents. In fp64, so that the comparison is of the
    math: in fp32 the two softmax orders differ by rounding, which the hyper-connections'
    gradients amplify to ~1e-4 relative (hc_head.hc_fn), while in fp64 they agree to ~1e-15."""
    window = tokens(65)[:, :-1] % 4096
    doc_ids = (torch.arange(64) >= 23).long().expand(2, 64) if docs else None
    positions = torch.arange(64).expand(2, 64)
    if docs:
        positions = torch.cat([torch.arange(23), torch.arange(41)]).expand(2, 64)
    results = {}
    for impl in ("dense", "gather"):
        cfg = replace(DEEPSEEK_V4_FLAVORS["debug"], sparse_attention=impl)
        model = build_model(cfg).train()
        model.init_weights(0)
        model.double()
        with torch.no_grad():  # sinks away from zero, so that their gradient is tested too
            for layer in model.layers.values():
                layer.attention.sinks.normal_(generator=torch.Generator().manual_seed(2))
        logits = model(window, positions, doc_ids)
        logits.pow(2).mean().backward()
        results[impl] = [logits.detach()] + [p.grad for p in model.parameters()]
    names = ["logits"] + [n for n, _ in model.named_parameters()]
    worst = 0.0
    for name, got, want in zip(names, results["gather"], results["dense"], strict=True):
        if want is None:
            assert got is None, name
            continue
        diff = ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()
        assert diff < 1e-10, f"{name}: max |diff| / max |value| {diff:.1e}"
        worst = max(worst, diff)
    print(f"gather vs dense: logits and {len(names) - 1} gradients, worst relative {worst:.1e}")


def test_indexer_loss_runs_dense_under_sparse_attention() -> None:
    """The indexer loss needs the attention's probabilities over every group, so a training
    forward with it runs the dense reference in CSA layers whatever sparse_attention says."""
    cfg = replace(DEEPSEEK_V4_FLAVORS["debug"], sparse_attention="gather", indexer_loss_weight=0.5)
    model = build_model(cfg).train()
    model.init_weights(0)
    model(tokens(64) % 4096)
    assert model.auxiliary_losses()["indexer"].item() > 0


def test_sparse_attention_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="sparse_attention must be one of auto, dense"):
        replace(DEEPSEEK_V4_FLAVORS["debug"], sparse_attention="flash").validate()


def test_blocks_compile_whole_with_the_hyper_connections() -> None:
    """As the trainer compiles them (compile_regions, fullgraph): each block, its two
    hyper-connections with their 20 Sinkhorn iterations included, is one graph without a break,
    compiled once per block kind, and computes what the eager blocks compute."""
    from torch._dynamo.utils import counters

    from torchloom.train.compile import CompileConfig, compile_regions

    cfg = replace(DEEPSEEK_V4_FLAVORS["debug"], num_layers=4,
                  attention_kinds=(SLIDING, SLIDING, CSA, HCA), hash_layers=3)  # fmt: skip
    eager, compiled = build_model(cfg), build_model(cfg)
    eager.init_weights(0)
    compiled.init_weights(0)
    torch._dynamo.reset()
    counters.clear()
    config = CompileConfig(enabled=True, regions=["DeepSeekV4Block"], backend="aot_eager")
    assert compile_regions(compiled, config) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (eager, compiled):
        loss = model(tokens).float().square().mean()
        loss.backward()
        losses.append(loss.item())
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    grad_diff = max(
        (a.grad - b.grad).abs().max().item()
        for a, b in zip(eager.parameters(), compiled.parameters(), strict=True)
        if a.grad is not None
    )
    print(f"graphs {graphs}, graph breaks {breaks}, losses {losses}, max grad diff {grad_diff:.1e}")
    # Kinds: sliding + hash (layers 0 and 1 share a graph), CSA + hash, HCA + routed.
    assert (graphs, breaks) == (3, 0)
    assert abs(losses[0] - losses[1]) < 1e-6 and grad_diff < 1e-6
    torch._dynamo.reset()
