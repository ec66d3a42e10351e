"""Training from a Hugging Face checkpoint (--checkpoint.initial_load_hf) and exporting one at the
end (--checkpoint.export_hf)."""

import json

import torch
import transformers

from torchloom.cli import resolve_job
from torchloom.train.trainer import Trainer


def test_train_from_hf_starts_at_its_loss_and_exports_for_transformers(tmp_path, hf_checkpoint):
    # The builtin tokenizer has 4096 ids; a larger HF vocabulary is fine.
    path, reference = hf_checkpoint("llama", vocab_size=4100)
    args = ["--recipe", "debug", "--checkpoint.initial_load_hf", str(path),
            "--training.steps", "2", "--training.sample_tokens", "0",
            "--metrics.tensorboard", "false", "--checkpoint.export_hf", "true",
            # transformers applies no document mask from position ids here: one causal stream.
            "--data.document_mask", "false", "--output.dir", str(tmp_path / "run")]  # fmt: skip
    _, job = resolve_job(args)
    trainer = Trainer(job)
    state = trainer.train_loader.state_dict()
    (batch,) = trainer.train_loader.next_step()  # the first step's batch, then rewind
    trainer.train_loader.load_state_dict(state)
    assert trainer.model_config.vocab_size == 4100 and trainer.model_config.dim == 64
    result = trainer.train()
    with torch.no_grad():
        # `shift_labels`: our labels are already the next tokens.
        hf_loss = reference(input_ids=batch.tokens, labels=batch.labels, shift_labels=batch.labels)
    print(f"first loss: trainer {result.first_loss:.6f}, transformers {hf_loss.loss.item():.6f}")
    assert abs(result.first_loss - hf_loss.loss.item()) < 1e-5
    assert result.steps == 2

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf").eval()
    tokens = batch.tokens[:2, :32]
    with torch.no_grad():
        diff = (exported(tokens).logits - trainer.model.eval()(tokens)).abs().max().item()
    print(f"exported model vs trained model: max abs logit diff {diff:.2e}")
    assert diff < 1e-4
    hf_config = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    assert hf_config["eos_token_id"] == trainer.tokenizer.eos_id
    assert (tmp_path / "run" / "hf" / "tokenizer.json").exists()


def test_a_seq_len_past_a_loaded_models_context_says_to_lower_it(tmp_path, hf_checkpoint):
    """The fix offered for a model built here (raise max_seq_len by an override) is refused
    for a model loaded from Hugging Face; only a lower seq_len is offered then."""
    import pytest

    from torchloom.config.errors import ConfigError

    path, _ = hf_checkpoint("llama", vocab_size=4100)
    max_len = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    _, job = resolve_job(["--recipe", "debug", "--checkpoint.initial_load_hf", str(path),
                          "--training.seq_len", str(2 * max_len),
                          "--output.dir", str(tmp_path / "run")])  # fmt: skip
    with pytest.raises(ConfigError, match=rf"lower seq_len \(a model loaded from {path} keeps"):
        Trainer(job)
