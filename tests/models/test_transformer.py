"""The generic decoder: shapes, causality, packed documents, tying, counts, FLOPs, init."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from torchloom.config.errors import ConfigError
from torchloom.models import Decoder, TransformerConfig
from torchloom.models.components.rope import RopeConfig

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

TINY = TransformerConfig(
    vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48, max_seq_len=64
)


def _model(cfg: TransformerConfig = TINY, seed: int = 0) -> Decoder:
    model = Decoder(cfg)
    model.init_weights(seed)
    return model


def _tokens(B: int = 2, T: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_hidden_states() -> None:
    model = _model()
    tokens = _tokens()
    logits = model(tokens)
    hidden = model.forward_hidden(tokens)
    assert logits.shape == (2, 16, TINY.vocab_size) and hidden.shape == (2, 16, TINY.dim)
    assert model.output is not None
    torch.testing.assert_close(logits, model.output(hidden))


def test_gradients_reach_every_parameter() -> None:
    model = _model(replace(TINY, qk_norm=True))
    model(_tokens()).logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing, missing


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@torch.no_grad()
def test_causal_future_tokens_do_not_change_the_past(backend: str) -> None:
    model = _model(replace(TINY, attn_backend=backend))
    tokens = _tokens()
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % TINY.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :10], before[:, :10], atol=0, rtol=0)
    assert (after[:, 10:] - before[:, 10:]).abs().max() > 1e-4


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@torch.no_grad()
def test_packed_document_matches_document_alone(backend: str) -> None:
    model = _model(replace(TINY, attn_backend=backend))
    doc1, doc2 = _tokens(1, 7, seed=1), _tokens(1, 9, seed=2)
    packed = torch.cat([doc1, doc2], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    doc_ids = torch.tensor([[0] * 7 + [1] * 9])
    packed_logits = model(packed, positions, doc_ids)
    torch.testing.assert_close(packed_logits[:, 7:], model(doc2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_logits[:, :7], model(doc1), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_sdpa_and_flex_models_agree() -> None:
    sdpa = _model(replace(TINY, qk_norm=True))
    flex = Decoder(replace(TINY, qk_norm=True, attn_backend="flex"))
    flex.load_state_dict(sdpa.state_dict())
    tokens = _tokens(2, 20)
    doc_ids = torch.tensor([[0] * 6 + [1] * 14, [0] * 13 + [1] * 4 + [2] * 3])
    for docs in (None, doc_ids):
        torch.testing.assert_close(flex(tokens, None, docs), sdpa(tokens, None, docs))


def test_flex_block_mask_is_built_once_per_forward(monkeypatch) -> None:
    """Every layer attends with the same BlockMask: one build per forward, not one per layer."""
    from torchloom.models.components import attention

    built = []

    def counting(*args, **kwargs):
        built.append(args[3:5])  # (q_len, kv_len)
        return create_block_mask(*args, **kwargs)

    create_block_mask = attention.create_block_mask
    monkeypatch.setattr(attention, "create_block_mask", counting)
    sdpa = _model(replace(TINY, qk_norm=True))
    flex = Decoder(replace(TINY, qk_norm=True, attn_backend="flex"))
    flex.load_state_dict(sdpa.state_dict())
    assert len(flex.layers) > 1
    tokens, docs = _tokens(2, 20), torch.tensor([[0] * 6 + [1] * 14, [0] * 20])
    with torch.no_grad():  # flex has no CPU backward
        torch.testing.assert_close(flex(tokens, None, docs), sdpa(tokens, None, docs))
    assert built == [(20, 20)]


def test_tied_embeddings_share_one_weight() -> None:
    model = _model(replace(TINY, tie_embeddings=True))
    assert model.output is None
    hidden = model.forward_hidden(_tokens())
    torch.testing.assert_close(model(_tokens()), hidden @ model.embed_tokens.weight.T)
    untied = TINY.num_params()
    assert sum(p.numel() for p in model.parameters()) == untied - TINY.vocab_size * TINY.dim


def test_tying_survives_meta_init() -> None:
    with torch.device("meta"):
        model = Decoder(replace(TINY, tie_embeddings=True))
    model.to_empty(device="cpu")
    model.init_weights(0)
    assert model.output is None and model.embed_tokens.weight.is_leaf


@pytest.mark.parametrize(
    "changes",
    [{}, {"tie_embeddings": True}, {"qk_norm": True}, {"head_dim": 12}, {"num_kv_heads": 4}],
)
def test_num_params_matches_the_module(changes: dict[str, object]) -> None:
    cfg = replace(TINY, **changes)
    model = Decoder(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    vocab = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    assert cfg.num_params(include_embedding=False) == cfg.num_params() - vocab


def test_flops_per_token_by_hand() -> None:
    cfg = TransformerConfig(
        vocab_size=10, dim=8, num_layers=3, num_heads=2, num_kv_heads=1, ffn_dim=16
    )
    # head_dim 4: q 8x8, k 8x4, v 8x4, o 8x8 = 192; mlp 3 * 8 * 16 = 384; per layer 576.
    n_matmul = 3 * 576 + 10 * 8  # + output head
    attention = 3 * 2 * 4 * 32  # layers * heads * head_dim * seq_len
    assert cfg.flops_per_token(32) == 6 * n_matmul + 6 * attention == 6 * 1808 + 4608
    assert replace(cfg, tie_embeddings=True).flops_per_token(32) == cfg.flops_per_token(32)


def test_init_is_reproducible_and_meta_safe() -> None:
    a, b, c = _model(seed=0), _model(seed=0), _model(seed=1)
    with torch.device("meta"):
        d = Decoder(TINY)
    d.to_empty(device="cpu")
    d.init_weights(0)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
        assert torch.equal(tensor, d.state_dict()[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(tensor, c.state_dict()[name]), name
    torch.testing.assert_close(a(_tokens()), d(_tokens()), atol=0, rtol=0)


def test_init_scales() -> None:
    cfg = replace(TINY, dim=128, ffn_dim=256, num_heads=8, num_kv_heads=8, init_std=0.05)
    model = _model(cfg)
    block = model.layers["0"]
    residual_std = 0.05 / math.sqrt(2 * cfg.num_layers)
    for weight, std in [
        (model.embed_tokens.weight, 0.05),
        (block.attention.q_proj.weight, 0.05),
        (block.attention.o_proj.weight, residual_std),
        (block.mlp.down_proj.weight, residual_std),
    ]:
        measured = weight.std().item()
        assert abs(measured / std - 1) < 0.05, f"std {measured:.4f}, expected about {std:.4f}"
    assert torch.equal(block.mlp_norm.weight, torch.ones(cfg.dim))
    bound = 3 * 0.05
    assert block.attention.q_proj.weight.abs().max() <= bound


@torch.no_grad()
def test_pipeline_stages_compose() -> None:
    """Stages keep their layer names and tolerate missing embedding / norm / head."""
    model = _model()
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["1"]
    first.norm, first.output = None, None
    del last.layers["0"]
    last.embed_tokens = None
    assert list(last.layers) == ["1"]
    tokens = _tokens()
    torch.testing.assert_close(last(first(tokens)), model(tokens))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"dim": 30}, "set head_dim explicitly"),
        ({"head_dim": 7}, "even"),
        ({"num_layers": 0}, "num_layers must be positive"),
        ({"attn_backend": "sdap"}, "Did you mean 'sdpa'"),
        ({"norm_impl": "torhc"}, "Did you mean 'torch'"),
        ({"rope": RopeConfig(scaling="yarnn")}, "Did you mean 'yarn'"),  # type: ignore[arg-type]
    ],
)
def test_validate_names_the_problem(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replace(TINY, **changes).validate()


def test_head_dim_independent_of_dim_is_valid() -> None:
    cfg = replace(TINY, head_dim=16)  # 4 heads * 16 = 64 != dim 32, as in Qwen3
    cfg.validate()
    assert _model(cfg)(_tokens()).shape == (2, 16, TINY.vocab_size)


@pytest.mark.gpu
def test_compiled_model_trains_with_either_backend_on_gpu() -> None:
    """Whole-model torch.compile (flex fused by the outer compile) gives sdpa's loss and grads."""
    tokens = _tokens(2, 160).cuda()
    doc_ids = torch.cat([torch.zeros(2, 60), torch.ones(2, 100)], dim=1).long().cuda()
    positions = torch.cat([torch.arange(60), torch.arange(100)])[None].expand(2, -1).cuda()
    losses, grads = [], []
    for backend in ("sdpa", "flex"):
        # head_dim 16: the fused flex kernel needs at least 16 channels per head.
        cfg = replace(TINY, attn_backend=backend, qk_norm=True, head_dim=16)
        model = _model(cfg).cuda()
        loss = torch.compile(model)(tokens, positions, doc_ids).logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    grad_diff = (grads[0] - grads[1]).abs().max().item()
    print(
        f"compiled sdpa vs flex: loss {losses[0]:.6f} vs {losses[1]:.6f}, grad diff {grad_diff:.2e}"
    )
    assert abs(losses[0] - losses[1]) < 1e-4 and grad_diff < 1e-4, (losses, grad_diff)
