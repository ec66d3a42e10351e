"""A multi-turn workload for the rollout tests and their benchmark (benchmarks/rl_turns.py): a
byte-level ChatML tokenizer whose stop set is a quarter of the vocabulary (so a random model's
replies end after a few tokens, as a chat model's do), environments whose tool calls sleep (in
this process, or in the Python sandbox), and the measures: how long each episode takes alone,
and the prompt tokens a run prefills."""

from __future__ import annotations

import time
from dataclasses import replace

from torchloom.generate.engine import Generator
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.rl.config import RLConfig
from torchloom.rl.env import Prompt, Turn
from torchloom.rl.rollout import Rollout, generate_rollouts
from torchloom.rl.tool_env import PythonToolEnv

START, END = "<|im_start|>", "<|im_end|>"
_WIDE = 0x4E00  # ids past the bytes and the two specials decode to CJK characters


class ByteChat:
    """Ids 0-255 are the bytes (as latin-1 characters), 256 and 257 ``<|im_start|>`` and
    ``<|im_end|>``; of the rest, every other one ends a reply (decodes as ``<|im_end|>``: with
    257, a quarter of a 512-token vocabulary), the others are one character each. The
    tokenizer methods rollouts use, nothing more."""

    def __init__(self, vocab_size: int = 512) -> None:
        self.vocab_size = vocab_size

    def stop_ids(self, chat: bool = False) -> tuple[int, ...]:
        return (257, *range(259, self.vocab_size, 2))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt=False):
        text = "".join(f"{START}{m['role']}\n{m['content']}{END}\n" for m in messages)
        return text + (f"{START}assistant\n" if add_generation_prompt else "")

    def encode_chat(self, text: str) -> list[int]:
        ids, at = [], 0
        while at < len(text):
            for token_id, special in ((256, START), (257, END)):
                if text.startswith(special, at):
                    ids.append(token_id)
                    at += len(special)
                    break
            else:
                code = ord(text[at])
                ids.append(code if code < 256 else code - _WIDE)
                at += 1
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        stops = set(self.stop_ids())
        parts = []
        for i in ids:
            if i in stops:
                parts.append("" if skip_special_tokens else END)
            elif i == 256:
                parts.append(START)
            else:
                parts.append(chr(i) if i < 256 else chr(_WIDE + i))
        return "".join(parts)


class SleepToolEnv:
    """``replies`` replies per episode: each but the last gets a tool call that sleeps its delay
    (``prompt.meta["delays"]``, times ``scale``) and answers with the reply's length; the last
    ends the episode, rewarded 1 when the reply's length is even. ``info["tool_s"]``: the
    seconds slept so far. ``fail_at``: the call (0-based) that raises instead."""

    def __init__(self, prompt: Prompt, scale: float = 1.0, fail_at: int | None = None) -> None:
        self.delays = [d * scale for d in prompt.meta["delays"]]
        self.max_turns = len(self.delays) + 1
        self.fail_at = fail_at
        self.calls, self.slept = 0, 0.0

    def reset(self, prompt: Prompt) -> str:
        return prompt.text

    def step(self, reply: str) -> Turn:
        call, self.calls = self.calls, self.calls + 1
        if call == self.fail_at:
            raise RuntimeError(f"tool failed at call {call}")
        info = {"calls": self.calls}
        if call == len(self.delays):
            return Turn(done=True, reward=float(len(reply) % 2 == 0), info={**info,
                        "tool_s": self.slept})  # fmt: skip
        time.sleep(self.delays[call])
        self.slept += self.delays[call]
        return Turn(observation=f"tool {call}: {len(reply)}", info={**info, "tool_s": self.slept})


class ScriptedPythonTool(PythonToolEnv):
    """The sandboxed Python tool (``PythonToolEnv``) with a script for replies, since a random
    model writes no code: ``len(delays)`` runs that sleep their delay (times ``scale``) and
    print the answer, then the answer. ``info["tool_s"]``: the seconds slept so far."""

    def __init__(self, prompt: Prompt, scale: float = 1.0) -> None:
        self.delays = [d * scale for d in prompt.meta["delays"]]
        super().__init__(max_turns=len(self.delays) + 1)
        self.slept = 0.0

    def step(self, reply: str) -> Turn:
        assert self._prompt is not None
        answer, call = self._prompt.answer, self._turns
        if call < len(self.delays):
            script = (
                f"```python\nimport time\ntime.sleep({self.delays[call]})\nprint({answer})\n```"
            )
            self.slept += self.delays[call]
        else:
            script = f"Answer: {answer}"
        turn = super().step(script)
        turn.info["tool_s"] = self.slept
        return turn


def tool_prompts(count: int, turns: int, tool_s: float, staggered: bool) -> list[Prompt]:
    """Prompts whose episodes make turns - 1 tool calls of ``tool_s`` each or, ``staggered``,
    one call of ``tool_s`` (at call i mod (turns - 1) for prompt i) and the others a tenth of
    it: every turn then has some slow episode, but no episode is slow twice. The answer (for
    ``ScriptedPythonTool``) is the prompt's index."""
    prompts = []
    for i in range(count):
        calls = turns - 1
        delays = [tool_s] * calls
        if staggered:
            delays = [tool_s if c == i % calls else tool_s / 10 for c in range(calls)]
        prompts.append(Prompt(f"Task {i}: talk to the tool.", answer=i, meta={"delays": delays}))
    return prompts


def tiny_model(family: str = "llama3", batch_invariant: bool = False, vocab_size: int = 512):
    """The family's debug flavor with a small vocabulary (sampling a row costs O(vocab))."""
    config = ModelConfig(name=family, flavor="debug", batch_invariant=batch_invariant,
                         overrides={"vocab_size": vocab_size})  # fmt: skip
    model = build_model(resolve_model_config(config))
    model.init_weights(0)
    return model.eval()


def rl_config(group_size: int, turns: int, max_new_tokens: int = 24) -> RLConfig:
    return RLConfig(group_size=group_size, max_turns=turns, max_new_tokens=max_new_tokens)


def alone_seconds(
    model,
    prompts: list[Prompt],
    cfg: RLConfig,
    rollouts: list[Rollout],
    max_len: int,
    env: type[SleepToolEnv | ScriptedPythonTool] = SleepToolEnv,
) -> list[float]:
    """Each episode's own time: the episode run alone (on an idle generator, same seeds, its
    tool calls not sleeping) plus the seconds its tool calls slept in the run
    (``info["tool_s"]``). Runs are at seed 0, step 0."""
    generator = Generator(model, max_batch=1, max_len=max_len)
    alone_cfg = replace(cfg, group_size=1)
    seconds = []
    for episode, rollout in enumerate(rollouts):
        prompt = prompts[episode // cfg.group_size]
        start = time.perf_counter()
        (again,) = generate_rollouts(
            generator, ByteChat(), [prompt], lambda p: env(p, scale=0.0), alone_cfg,
            seed=0, step=0, version=0, groups=[episode],
        ).rollouts  # fmt: skip
        generation_s = time.perf_counter() - start
        assert again.tokens == rollout.tokens, f"episode {episode} alone took other tokens"
        seconds.append(generation_s + rollout.info.get("tool_s", 0.0))
    return seconds


def prefill_counts(rollouts: list[Rollout], group_size: int) -> tuple[int, int]:
    """(kept, whole): the prompt tokens a run prefills when each turn continues its cache
    (the environment's message and the last reply token, which was sampled but not fed), and
    when each turn prefills its whole context again. A group's first prompt counts once
    (its members share that prefill) either way."""
    kept = whole = 0
    for index, rollout in enumerate(rollouts):
        starts = [
            i for i, m in enumerate(rollout.mask) if m and (i == 0 or not rollout.mask[i - 1])
        ]
        first = starts[0]
        if index % group_size == 0:
            kept += first
            whole += first
        for previous_end, start in zip(_reply_ends(rollout.mask), starts[1:]):
            kept += start - previous_end + 1
            whole += start
    return kept, whole


def _reply_ends(mask: list[bool]) -> list[int]:
    return [i + 1 for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]
