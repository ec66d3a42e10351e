"""deepseek_v3: the flavors against the published counts, packed documents against separate
sequences, the multi-token-prediction loss against a direct computation (and when it runs),
and the layouts a model with MTP refuses."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from torchloom.config.errors import ConfigError
from torchloom.models import build_model
from torchloom.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3
from torchloom.models.deepseek_v3.parallelize import tp_plan
from torchloom.train.builders import check_layout
from torchloom.train.loss import IGNORE_INDEX, CrossEntropy

# (total parameters, active per token) as published: DeepSeek-V2-Lite, DeepSeek-V2,
# DeepSeek-V3 (its main model: the 14B MTP module comes on top), Kimi-K2 (1.03T, 32B).
PUBLISHED = {"16B": (15.7e9, 2.4e9), "236B": (236e9, 21e9), "671B": (671e9, 37e9),
             "kimi-k2": (1.03e12, 32e9)}  # fmt: skip


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavors_have_the_published_sizes(flavor: str) -> None:
    cfg = replace(DEEPSEEK_V3_FLAVORS[flavor], mtp_layers=0)
    total, active = PUBLISHED[flavor]
    counted = cfg.num_params()
    # Active: what a token's forward multiplies (6 FLOPs per weight at seq_len 0).
    used = cfg.flops_per_token(0) / 6
    print(f"{flavor}: {counted / 1e9:.3f}B parameters ({total / 1e9:g}B published), "
          f"{used / 1e9:.2f}B active ({active / 1e9:g}B published)")  # fmt: skip
    assert abs(counted / total - 1) < 0.005
    assert abs(used / active - 1) < 0.03


def test_mtp_module_adds_what_deepseek_v3_publishes() -> None:
    """685B on the hub = 671B + a 14B MTP module that also stores the embedding and head."""
    cfg = DEEPSEEK_V3_FLAVORS["671B"]
    mtp = cfg.num_params() - replace(cfg, mtp_layers=0).num_params()
    with_copies = mtp + 2 * cfg.vocab_size * cfg.dim
    print(f"MTP module: {mtp / 1e9:.2f}B, {with_copies / 1e9:.2f}B with the copies")
    assert abs(with_copies / 14e9 - 1) < 0.05


def tiny(**changes) -> DeepSeekV3:
    cfg = replace(DEEPSEEK_V3_FLAVORS["debug"], vocab_size=256, **changes)
    model = build_model(cfg)
    model.init_weights(0)
    with torch.no_grad():  # a non-zero choice bias
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.01 * torch.randn(buffer.shape, generator=torch.Generator()))
    return model


DOCS = [11, 7, 14]  # lengths of three documents packed into one row of 32


def packed_batch(
    vocab: int, docs: list[int], ignored: tuple[tuple[int, int], ...]
) -> tuple[torch.Tensor, ...]:
    """(tokens, positions, doc_ids, labels) of two rows of ``docs`` packed, random tokens below
    ``vocab``; each document's last label and the ``ignored`` (row, position) labels ignored."""
    generator = torch.Generator().manual_seed(1)
    window = torch.randint(0, vocab, (2, sum(docs) + 1), generator=generator)
    tokens, labels = window[:, :-1], window[:, 1:].clone()
    ends = torch.tensor(docs).cumsum(0) - 1
    labels[:, ends] = IGNORE_INDEX  # a document's last token predicts nothing (as packing does)
    for row, position in ignored:
        labels[row, position] = IGNORE_INDEX
    doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(docs)]).expand(2, -1)
    positions = torch.cat([torch.arange(n) for n in docs]).expand(2, -1)
    return tokens, positions, doc_ids, labels


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@torch.no_grad()
def test_packed_documents_equal_separate_sequences(backend: str) -> None:
    model = tiny(attn_backend=backend).eval()
    tokens = torch.randint(0, 256, (1, sum(DOCS)), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(DOCS)])[None]
    positions = torch.cat([torch.arange(n) for n in DOCS])[None]
    packed = model(tokens, positions, doc_ids)[0]
    alone = torch.cat([model(part) for part in tokens.split(DOCS, dim=1)], dim=1)[0]
    diff = (packed - alone).abs().max().item()
    print(f"{backend}: packed vs separate max |diff| {diff:.1e}")
    assert diff < 1e-5


def mtp_loss_directly(
    model: DeepSeekV3, tokens: torch.Tensor, labels: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """lambda / D * sum_k mean CE, each document run alone and every target taken one by one."""
    D = model.config.mtp_layers
    depth_losses = []
    for k, mtp in enumerate(model.mtp.layers.values(), start=1):
        terms = []
        for row in range(tokens.shape[0]):
            for doc_tokens, doc_labels in zip(
                tokens[row].split(lengths), labels[row].split(lengths)
            ):
                T = len(doc_tokens)
                h = model.run_blocks(model.embed_tokens(doc_tokens[None]),
                                     model.layer_inputs(doc_tokens[None]))  # fmt: skip
                for depth, step in enumerate(list(model.mtp.layers.values())[:k], start=1):
                    ahead = torch.cat([doc_tokens[depth:], doc_tokens.new_zeros(depth)])
                    h, normed = step(h, model.embed_tokens(ahead[None]),
                                     model.layer_inputs(doc_tokens[None]))  # fmt: skip
                logits = model.logits(normed)[0]
                for i in range(T - k):  # position i predicts the label of i + k
                    if doc_labels[i + k] != IGNORE_INDEX:
                        terms.append(F.cross_entropy(logits[i], doc_labels[i + k]))
        depth_losses.append(torch.stack(terms).mean())
        assert mtp is step
    return model.config.mtp_loss_weight / D * sum(depth_losses)


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_loss_equals_a_direct_computation(depths: int) -> None:
    """Two rows of three packed documents, some labels ignored; the MTP term the objective
    receives equals the loss computed target by target."""
    model = tiny(mtp_layers=depths, mtp_loss_weight=0.1).train()
    tokens, positions, doc_ids, labels = packed_batch(256, DOCS, ignored=((0, 3), (1, 20)))
    out = model(tokens, positions, doc_ids, objective=CrossEntropy(), targets={"labels": labels})
    count = (labels != IGNORE_INDEX).sum()
    reported = out.metrics["aux_mtp"] / count  # with_auxiliary weights it by the label count
    with torch.no_grad():
        direct = mtp_loss_directly(model, tokens, labels, DOCS)
    print(f"D={depths}: MTP loss {reported.item():.6f}, direct {direct.item():.6f}")
    torch.testing.assert_close(reported, direct, rtol=1e-5, atol=0)
    out.loss.backward()
    assert all(p.grad is not None for p in model.mtp.parameters())


def test_mtp_runs_only_in_training_forwards_with_labels() -> None:
    model = tiny()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    targets = {"labels": tokens.roll(-1, 1)}
    calls = []
    model.mtp.register_forward_hook(lambda *_: calls.append(1))
    model.train()
    logits = model(tokens)  # no objective: plain logits
    assert logits.shape == (2, 16, 256) and not calls
    model.eval()
    assert "aux_mtp" not in model(tokens, objective=CrossEntropy(), targets=targets).metrics
    model.train()
    assert "aux_mtp" in model(tokens, objective=CrossEntropy(), targets=targets).metrics
    assert calls == [1] and model.auxiliary_losses() == {}  # handed over once


def test_layouts_a_model_with_mtp_refuses() -> None:
    model = tiny()
    for axis in ("pp", "cp"):
        degrees = SimpleNamespace(pp=2 if axis == "pp" else 1, cp=2 if axis == "cp" else 1)
        with pytest.raises(ConfigError, match=rf"--parallel.{axis} 2 with multi-token prediction"):
            check_layout(model, SimpleNamespace(degrees=degrees))
    # Tensor parallelism splits the MTP depth as a layer (run: tests/parallel/
    # test_expert_parallel_trainer.py); generation's plan leaves it alone.
    plan = tp_plan(model, 2)
    assert {"mtp.layers.3.eh_proj", "mtp.layers.3.block.attention.o_proj"} <= set(plan)
    assert not any(path.startswith("mtp.") for path in tp_plan(model, 2, sequence_parallel=False))
    without = tiny(mtp_layers=0)
    check_layout(without, SimpleNamespace(degrees=SimpleNamespace(pp=2, cp=1)))
    with pytest.raises(ConfigError, match="--parallel.cp 2 supports grouped-query attention "
                       "layers only; this model's MultiHeadLatentAttention layers"):  # fmt: skip
        check_layout(without, SimpleNamespace(degrees=SimpleNamespace(pp=1, cp=2)))


CONFIG_ERRORS = {
    "mtp_layers": ({"mtp_layers": -1}, "mtp_layers and mtp_loss_weight must be >= 0"),
    "rope dim": ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
    "dense layers": ({"first_dense_layers": 4}, r"first_dense_layers must be in \[0, num_layers=3\]"),
    "q rank": ({"q_lora_rank": -8}, "q_lora_rank must be positive, or null"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_impossible_configs_are_refused_by_name(case: str) -> None:
    change, message = CONFIG_ERRORS[case]
    with pytest.raises(ConfigError, match=message):
        replace(DEEPSEEK_V3_FLAVORS["debug"], **change).validate()
