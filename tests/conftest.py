import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Two cores: keep intra-op threads predictable and avoid oversubscription under pytest.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_addoption(parser):
    parser.addoption(
        "--shard",
        default=None,
        metavar="I/N",
        help="run only the I-th of N interleaved parts of the selected tests (1 <= I <= N; "
        "`make test-gpu SHARD=1/2` then SHARD=2/2 fits a device's ten-minute limit a call)",
    )


def _shard(config, items):
    """Keep every N-th selected test from the I-th on: N shards are disjoint and, together,
    every test (nothing to keep in sync by hand as tests are added)."""
    spec = config.getoption("--shard")
    if spec is None:
        return
    index, _, count = spec.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise pytest.UsageError(f"--shard {spec!r}: want I/N with 1 <= I <= N, e.g. --shard 1/2")
    keep = items[int(index) - 1 :: int(count)]
    kept = set(keep)
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Marks first (before -m reads them), then, once -m and -k have deselected, the shard of
    what is left."""
    # `make test` stays short (-m "not slow"): a multi-process test (torchrun, 5-15 s a launch
    # before it does anything) is slow unless it is one of the trimmed core; `make test-slow`
    # runs the rest, and CI runs both.
    for item in items:
        if "distributed" in item.keywords and "multiprocess_core" not in item.keywords:
            item.add_marker(pytest.mark.slow)
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    yield  # every other plugin's hook: -m and -k deselect here
    _shard(config, items)


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """In-process tests on one-rank gloo groups (--parallel.fsdp_always, RL's weight sync) leave
    gloo's threads running to the end, their groups kept alive by DTensor's caches; at teardown
    such a thread can abort the interpreter after every result was reported (see
    torchloom.parallel.leave). Then pytest leaves as a torchrun rank does, with its own code."""
    tasks = "/proc/self/task"
    names = []
    for task in os.listdir(tasks) if os.path.isdir(tasks) else ():
        try:
            with open(f"{tasks}/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    if any(name.startswith(("gloo", "pt_gloo")) for name in names):
        from torchloom.parallel import leave

        leave(config.stash.get(_EXIT_STATUS, 0))


@pytest.fixture(scope="session", autouse=True)
def shared_cache_dir(tmp_path_factory):
    """One cache (built-in corpus, tokenizer, tokenized data) for the whole test session."""
    path = tmp_path_factory.mktemp("torchloom_cache")
    previous = os.environ.get("TORCHLOOM_CACHE")
    os.environ["TORCHLOOM_CACHE"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("TORCHLOOM_CACHE", None)
    else:
        os.environ["TORCHLOOM_CACHE"] = previous


# Tiny Hugging Face checkpoints for the interop tests (tests/models/test_*_hf.py, tests/checkpoint).
_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
}
_HF_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Build a tiny transformers model with random weights (norms and MoE routing biases
    included, so every weight matters), ``save_pretrained`` it under tmp_path/name: returns
    (folder, model in eval mode)."""

    def build(model_type, name="hf", max_shard_size=None, seed=0, **config):
        import transformers

        transformers.utils.logging.disable_progress_bar()
        config_name, model_name = _HF_CLASSES[model_type]
        hf_config = getattr(transformers, config_name)(
            **(_HF_TINY | config), attn_implementation="eager"
        )
        model = getattr(transformers, model_name)(hf_config)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(1 + 0.1 * noise if "norm" in param_name else 0.1 * noise)
            for buffer_name, buffer in model.named_buffers():  # zero-initialized routing bias
                if buffer_name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
        path = tmp_path / name
        model.save_pretrained(
            path, **({"max_shard_size": max_shard_size} if max_shard_size else {})
        )
        return path, model.eval()

    return build


@pytest.fixture
def hf_training_step(hf_checkpoint):
    """``step(model_type, length=33, **config)``: a tiny random transformers checkpoint
    (``hf_checkpoint``), torchloom's model read from it, and one training step of each on the
    same random window (ours gets w[:-1] with labels w[1:], as the trainer computes the loss;
    transformers shifts inside, so it gets w). Asserts the losses agree (rtol 1e-5) and returns
    (model, reference), their gradients in place."""

    def step(model_type, length=33, **config):
        import torchloom
        from torchloom.train.loss import cross_entropy_sum

        path, reference = hf_checkpoint(model_type, **config)
        model = torchloom.from_hf(path).train()
        reference.train()
        window = torch.randint(0, 512, (2, length), generator=torch.Generator().manual_seed(1))
        inputs, labels = window[:, :-1], window[:, 1:]
        loss = cross_entropy_sum(model(inputs), labels) / labels.numel()
        loss.backward()
        hf_loss = reference(input_ids=window, labels=window).loss
        hf_loss.backward()
        print(f"{model_type} loss: ours {loss.item():.6f}, transformers {hf_loss.item():.6f}")
        torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=0)
        return model, reference

    return step


@pytest.fixture
def logits_parity():
    """Compare two logits tensors: print the max abs difference and KL(theirs || ours), and
    assert a relative error (max abs diff / max abs logit) below ``rel``."""

    def compare(label, ours, theirs, rel=1e-5):
        diff = (ours - theirs).abs().max().item()
        relative = diff / theirs.abs().max().item()
        log_p, log_q = theirs.double().log_softmax(-1), ours.double().log_softmax(-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
        print(f"{label}: max abs logit diff {diff:.2e} (relative {relative:.1e}), KL {kl:.1e}")
        assert relative < rel, f"{label}: relative logit error {relative:.2e} >= {rel}"

    return compare


@pytest.fixture(scope="session")
def torchrun_train():
    """``run(nproc, *args)``: `torchrun --standalone -m torchloom train ARGS` on ``nproc`` gloo
    processes (one thread each); fails the test with the end of the output if it fails."""

    def run(nproc: int, *args: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "torchloom", "train", *args]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-16000:]

    return run


@pytest.fixture(autouse=True)
def fresh_dynamo_for_gpu_tests(request):
    """Each GPU test compiles from a fresh dynamo. Its recompile limit (8) counts per code
    object across the process, so compiled blocks of earlier tests (fa4's packed steps, the
    training runs) otherwise use up a later fullgraph test's budget for the same forward."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        torch._dynamo.reset()
    yield


@pytest.fixture
def run_in_triton_interpreter() -> Callable[[str], None]:
    """Runs a test file as a script with TRITON_INTERPRET=1 (Triton reads it when imported, so
    the kernels need a fresh process) and fails, with the script's output, unless it exits 0.
    The script runs under tests/sm90_launches.py, which then compiles every kernel it launched
    for sm_90 (no GPU needed): what compiles for the GPU is checked with what computes here."""

    def run(path: str) -> None:
        if importlib.util.find_spec("triton") is None:
            if sys.platform != "linux":
                pytest.skip("Triton ships for Linux only")
            pytest.fail("Triton is not installed, so its kernels go untested: pip install "
                        "triton (or the dev extra)")  # fmt: skip
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        bootstrap = str(Path(__file__).with_name("sm90_launches.py"))
        result = subprocess.run(
            [sys.executable, bootstrap, path], env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        print(result.stdout)
        assert result.returncode == 0, result.stdout + result.stderr

    return run
