"""The Python sandbox (torchloom/rl/sandbox.py) and the tool environment built on it
(torchloom/rl/tool_env.py). Each run starts an interpreter (~0.1 s); the file stays fast."""

from __future__ import annotations

import itertools
import json
import os
import socket
import time

import pytest

from torchloom.config.errors import ConfigError
from torchloom.rl import tool_env
from torchloom.rl.config import RLConfig
from torchloom.rl.env import Prompt
from torchloom.rl.isolation import readable_paths
from torchloom.rl.sandbox import SandboxResult, probe_isolation, run_python
from torchloom.rl.tool_env import PythonToolEnv, tool_prompts


def _describe(result: SandboxResult) -> str:
    return (
        f"exit {result.exit_code}, killed {result.killed_reason}, {result.wall_s:.2f} s, "
        f"netns {result.network_isolated}, filesystem {result.filesystem_isolation}\nstdout: {result.stdout!r}\nstderr: {result.stderr!r}"
    )


def test_prints_come_back() -> None:
    result = run_python("import sys\nprint('hello', 6 * 7)\nprint('oops', file=sys.stderr)")
    assert result.ok, _describe(result)
    assert (result.stdout, result.stderr) == ("hello 42\n", "oops\n"), _describe(result)
    assert not result.truncated and not result.timed_out


def test_errors_show_the_models_traceback_and_exit_code() -> None:
    result = run_python("x = 1\n1 / 0")
    assert result.exit_code == 1, _describe(result)
    assert 'File "main.py", line 2' in result.stderr, _describe(result)
    assert result.stderr.strip().endswith("ZeroDivisionError: division by zero"), _describe(result)
    assert run_python("import sys; sys.exit(3)").exit_code == 3


def test_infinite_loop_is_killed_at_the_wall_limit() -> None:
    start = time.monotonic()
    result = run_python("print('started')\nwhile True:\n    pass", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.killed_reason == "timeout", _describe(result)
    assert elapsed < 3.0, f"returned after {elapsed:.2f} s for a 1 s limit"
    assert result.stdout == "started\n", _describe(result)  # lines printed before the kill


def test_memory_bomb_fails_in_the_child() -> None:
    at_once = run_python("x = bytearray(10**10)", memory_mb=128)
    assert at_once.exit_code == 1 and "MemoryError" in at_once.stderr, _describe(at_once)
    growing = run_python(
        "chunks = []\nwhile True:\n    chunks.append(bytearray(2**20))", memory_mb=128, timeout_s=20
    )
    assert growing.exit_code == 1 and "MemoryError" in growing.stderr, _describe(growing)


def test_network_is_blocked() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        code = f"""
import socket
for name, attempt in [
    ("connect", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2)),
    ("getaddrinfo", lambda: socket.getaddrinfo("localhost", 80)),
]:
    try:
        attempt()
        print(name, "worked")
    except OSError as error:
        print(name, "failed:", type(error).__name__)
"""
        result = run_python(code)
        try:
            connection, _ = listener.accept()
            connection.close()
            accepted = True
        except TimeoutError:
            accepted = False
    assert not accepted, "the sandboxed code reached a socket of the test process"
    assert "worked" not in result.stdout, _describe(result)
    assert result.stdout.count("failed: PermissionError") == 2, _describe(result)


def test_writes_stay_in_the_working_folder(tmp_path) -> None:
    outside = tmp_path / "escaped.txt"
    code = f"""
import os
for name, attempt in [
    ("open", lambda: open({str(outside)!r}, "w")),
    ("os.open", lambda: os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT)),
    ("climb", lambda: open(os.path.relpath({str(outside)!r}), "w")),
    ("rename", lambda: os.rename("main.py", {str(outside)!r})),
    ("mkdir", lambda: os.mkdir({str(tmp_path / "made")!r})),
    ("symlink", lambda: os.symlink({str(tmp_path)!r}, "link")),
]:
    try:
        attempt()
        print(name, "worked")
    except PermissionError:
        print(name, "refused")
with open("inside.txt", "w") as f:
    f.write("kept")
print(open("inside.txt").read())
"""
    result = run_python(code)
    assert result.ok, _describe(result)
    assert result.stdout.count("refused") == 6 and "worked" not in result.stdout, _describe(result)
    assert result.stdout.endswith("kept\n"), _describe(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a write escaped the sandbox"


def _attempts(attempts: dict[str, str]) -> str:
    """Code that runs each expression and prints {name: ["ok", value] or ["error", type]}."""
    lines = ["import json, os", "seen = {}"]
    for name, expression in attempts.items():
        lines += [
            "try:",
            f"    seen[{name!r}] = ['ok', {expression}]",
            "except OSError as error:",
            f"    seen[{name!r}] = ['error', type(error).__name__]",
        ]
    return "\n".join([*lines, "print(json.dumps(seen))"])


def _try_in_sandbox(attempts: dict[str, str], refused: tuple[str, ...]) -> tuple[dict, str]:
    """Run ``attempts`` in one isolated run; assert the ``refused`` ones raised OSError; return
    what each gave and the run's stdout."""
    result = run_python(_attempts(attempts))
    assert result.ok and result.filesystem_isolation, _describe(result)
    seen = json.loads(result.stdout)
    for name in refused:
        assert seen[name][0] == "error", (name, seen[name], result.filesystem_isolation)
    return seen, result.stdout


def test_files_outside_the_folder_cannot_be_read(tmp_path) -> None:
    """/etc/passwd, a secret by absolute path, a home-like folder and the real home: the code
    reads and lists none of them (its own folder and the standard library still work)."""
    secret = tmp_path / "secret.txt"
    secret.write_text("token-1234")
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("private key")
    real_home = os.path.expanduser("~")
    seen, stdout = _try_in_sandbox({
        "passwd": "open('/etc/passwd').read()",
        "secret": f"open({str(secret)!r}).read()",
        "key": f"open({str(home / '.ssh' / 'id_ed25519')!r}).read()",
        "home": f"sorted(os.listdir({str(home)!r}))",
        "real home": f"sorted(os.listdir({real_home!r}))",
        "own folder": "open('main.py').read(1) and sorted(os.listdir('.'))",
        "stdlib": "str(__import__('fractions').Fraction(2, 6))",
    }, refused=("passwd", "secret", "key", "home"))  # fmt: skip
    # The home folder may hold the Python installation (pyenv): only the way there shows.
    on_the_way = {p[len(real_home) + 1 :].split("/")[0] for p in readable_paths()
                  if p.startswith(real_home + "/")}  # fmt: skip
    if seen["real home"][0] == "ok":
        assert set(seen["real home"][1]) <= on_the_way, (seen["real home"], on_the_way)
    assert seen["own folder"] == ["ok", ["main.py"]], seen
    assert seen["stdlib"] == ["ok", "1/3"], seen
    assert "token-1234" not in stdout and "private key" not in stdout


def test_mkfifo_outside_the_folder_fails_and_leaves_nothing(tmp_path) -> None:
    """A FIFO left behind would block whatever opens it later; only the folder (deleted after
    the run) takes one."""
    seen, _ = _try_in_sandbox({
        "tmp_path": f"os.mkfifo({str(tmp_path / 'fifo')!r})",
        "beside the folder": "os.mkfifo(os.path.dirname(os.getcwd()) + '/fifo')",
        "inside": "os.mkfifo('fifo') or sorted(os.listdir('.'))",
    }, refused=("tmp_path", "beside the folder"))  # fmt: skip
    assert seen["inside"] == ["ok", ["fifo", "main.py"]], seen
    assert list(tmp_path.iterdir()) == [], "a FIFO escaped the sandbox"


def test_tool_env_refuses_to_start_without_isolation(monkeypatch) -> None:
    """Where neither a mount namespace nor Landlock works (simulated: the probe finds none),
    the environment refuses in one line naming the flag; the unsafe flag lets it run."""
    monkeypatch.setattr(tool_env, "probe_isolation", lambda: ())
    with pytest.raises(ConfigError) as refusal:
        PythonToolEnv()
    message = str(refusal.value)
    assert "\n" not in message and "--rl.unsafe_sandbox true" in message, message
    env = PythonToolEnv(unsafe_sandbox=True)
    env.reset(Prompt("What is 6 * 7?", answer="42"))
    turn = env.step("```python\nprint(6 * 7)\n```")
    assert turn.observation == "Output:\n42" and turn.info["tool_ok"], turn
    with pytest.raises(ConfigError, match="python_tool"):
        RLConfig(task="arithmetic", unsafe_sandbox=True).validate()


def test_this_machine_isolates_the_filesystem() -> None:
    """What the probe finds here; the tests above need at least one mechanism."""
    found = probe_isolation()
    print(f"filesystem isolation here: {found or 'none'}")
    assert found, "neither a mount namespace nor Landlock works on this machine"


def test_processes_are_refused() -> None:
    code = """
import os, subprocess
for name, attempt in [
    ("subprocess", lambda: subprocess.run(["true"])),
    ("os.system", lambda: os.system("true")),
    ("os.fork", os.fork),
    ("os.kill", lambda: os.kill(os.getppid(), 0)),
]:
    try:
        attempt()
        print(name, "worked")
    except PermissionError:
        print(name, "refused")
"""
    result = run_python(code)
    assert result.ok, _describe(result)
    assert result.stdout.count("refused") == 4, _describe(result)


def test_large_output_is_truncated_quickly() -> None:
    start = time.monotonic()
    result = run_python("print('x' * 10**6)\nwhile True:\n    pass", max_output_chars=100)
    elapsed = time.monotonic() - start
    assert result.truncated and result.killed_reason == "output_limit", _describe(result)
    assert result.stdout == "x" * 100, _describe(result)
    assert elapsed < 4.0, f"took {elapsed:.2f} s to cut 1 MB of output (timeout 5 s)"


def test_tool_env_runs_code_then_scores_the_answer() -> None:
    prompt = Prompt("What is 123456 * 789?", answer="97406784")
    env = PythonToolEnv(max_turns=3)
    assert env.reset(prompt).startswith("What is 123456 * 789?")
    turn = env.step("Let me compute it.\n```python\nprint(123456 * 789)\n```")
    assert not turn.done and turn.observation == "Output:\n97406784", turn
    assert turn.info["tool_calls"] == 1
    turn = env.step("The tool says so.\nAnswer: 97406784")
    assert turn.done and turn.reward == 1.0, turn

    env.reset(prompt)
    turn = env.step("Answer: 97406785")
    assert turn.done and turn.reward == 0.0 and turn.info["answer"] == "97406785", turn


def test_tool_env_cuts_the_episode_at_max_turns() -> None:
    env = PythonToolEnv(max_turns=2)
    env.reset(Prompt("What is 2 + 2?", answer="4"))
    turn = env.step("```python\nraise ValueError('no')\n```")
    assert not turn.done and "ValueError: no" in turn.observation, turn
    assert "[exit code 1]" in turn.observation, turn
    turn = env.step("```python\nprint(4)\n```")
    assert turn.done and turn.reward == 0.0, turn


def test_tool_prompts_resume_with_the_same_prompts() -> None:
    source = tool_prompts(seed=7)
    stream = iter(source)
    seen = list(itertools.islice(stream, 20))
    state = source.state_dict()
    expected = [(p.text, p.answer) for p in itertools.islice(stream, 5)]

    resumed = tool_prompts(seed=7)
    resumed.load_state_dict(state)
    got = [(p.text, p.answer) for p in itertools.islice(iter(resumed), 5)]
    assert got == expected
    other_seed = list(itertools.islice(iter(tool_prompts(seed=8)), 5))
    assert [p.text for p in other_seed] != [p.text for p in seen[:5]]
    assert len({p.meta["task"] for p in seen}) == 4, [p.meta for p in seen]
    for prompt in seen:
        if prompt.meta["task"] == "product":
            a, b = prompt.text.removeprefix("What is ").removesuffix("?").split(" * ")
            assert prompt.answer == int(a) * int(b), prompt


def test_tool_env_runs_in_the_rollout_pool() -> None:
    """8 episodes of sandboxed tool use through generate_rollouts (scripted replies: two runs
    that sleep 1 s and print the answer, then the answer): every run happens in the
    environments' thread pool, each episode gets its outputs and its reward, and the 16 runs
    overlap (one after another they would take 16 s)."""
    from tests.rl.turns import ByteChat, ScriptedPythonTool, rl_config, tiny_model, tool_prompts
    from torchloom.generate.engine import Generator
    from torchloom.rl.rollout import generate_rollouts

    cfg = rl_config(group_size=4, turns=3, max_new_tokens=4)
    batch = generate_rollouts(
        Generator(tiny_model(), max_batch=8, max_len=512), ByteChat(),
        tool_prompts(2, turns=3, tool_s=1.0, staggered=False), ScriptedPythonTool, cfg,
        seed=0, step=0, version=0,
    )  # fmt: skip
    print(f"8 episodes, 16 runs of 1 s: {batch.seconds:.2f} s")
    for rollout in batch.rollouts:  # the tool runs on every reply, a cut one too
        assert rollout.info["tool_calls"] == min(rollout.turns, 2), rollout.info
        if rollout.finish_reason != "length":  # a reply cut before the script's end
            assert (rollout.finish_reason, rollout.reward) == ("stop", 1.0), rollout.info
    assert sum(r.info["tool_calls"] for r in batch.rollouts) >= 8
    assert any(r.reward == 1.0 for r in batch.rollouts)
    assert batch.seconds < 8.0
