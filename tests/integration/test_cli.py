"""The `bubbletea` and `loadgen` commands as a new user meets them (issue 37): the real entry points
in a subprocess; every everyday mistake gives one line, a non-zero exit and no traceback."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import redis as redis_lib
from redis.asyncio import Redis

from bubbletea.cli import main as cli_main
from shared.runtime.redis_server import EmbeddedRedis, free_port
from shared.wire import keys

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*args: str, env: dict[str, str] | None = None, tool: str = "bubbletea") -> subprocess.CompletedProcess[str]:
    """`tool ARGS` as a user runs it: the installed script, this checkout's directory, no REDIS_URL."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("BUBBLETEA_") and k != "REDIS_URL"}
    return subprocess.run(
        [str(BIN / tool), *args], env={**base, **(env or {})}, capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def one_line_error(r: subprocess.CompletedProcess[str], line: str, code: int = 2) -> None:
    """Exit `code`, no traceback, and `line` as the last line on stderr."""
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == line, r.stderr[-2000:]


@pytest.mark.parametrize("tool", ["bubbletea", "loadgen"])
def test_version_is_the_installed_distributions(tool: str) -> None:
    r = run("--version", tool=tool)
    assert r.returncode == 0 and r.stdout == f"{tool} {version('bubbletea')}\n"


def test_bare_bubbletea_prints_its_help_not_an_error() -> None:
    r = run()
    assert r.returncode == 0 and r.stdout.startswith("usage: bubbletea") and "COMMAND" in r.stdout
    assert "error" not in r.stderr


def test_plan_gives_a_slow_link_in_the_unit_that_shows_it() -> None:
    from bubbletea.plan import bits_per_s

    assert [bits_per_s(x) for x in (25e9, 3.2768e6, 9600.0, 12.0)] == ["25.00 Gb/s", "3.28 Mb/s", "9.60 kb/s", "12 b/s"]
    r = run("plan", "--config", "configs/demo.yaml")
    assert r.returncode == 0 and "3.28 Mb/s" in r.stdout and "0.00 Gb/s" not in r.stdout


def test_every_command_that_reads_a_spec_takes_it_as_an_argument_too() -> None:
    for command in ("plan", "check-config", "simulate"):
        assert "SPEC" in run(command, "--help").stdout, command
    by_flag = run("plan", "--json", "--config", "configs/wan-bound.yaml")
    assert by_flag.returncode == 0 and run("plan", "--json", "configs/wan-bound.yaml").stdout == by_flag.stdout
    one_line_error(
        run("plan", "configs/demo.yaml", "--config", "configs/wan-bound.yaml"),
        "bubbletea: error: two specs named (configs/demo.yaml and --config configs/wan-bound.yaml): name one",
    )


def test_health_names_the_services_it_knows() -> None:
    one_line_error(
        run("health", "bogus"),
        "bubbletea: error: argument SERVICE: invalid choice: 'bogus' (choose from 'prefill_queue', 'wan_broker', "
        "'stage_worker', 'dispatcher', 'decoder')",
    )


def test_usage_and_configuration_errors_share_one_prefix(tmp_path: Path) -> None:
    one_line_error(run("plan", "--bogus"), "bubbletea: error: unrecognized arguments: --bogus")
    one_line_error(run("plan", "--fwd-ms", "x"), "bubbletea: error: argument --fwd-ms: invalid float value: 'x'")
    bad = tmp_path / "bad.yaml"
    bad.write_text("datacenters: [{name: a, gpus: -3}]\n")
    for command in (["check-config", str(bad)], ["plan", "--config", str(bad)], ["simulate", "--config", str(bad)]):
        one_line_error(
            run(*command),
            f"bubbletea: error: {bad}: datacenters[0].gpus: Expected `int` >= 1 (allowed: >= 1 and <= 1000000)",
        )


BUG = (
    "import sys, bubbletea.cli_inspect as c\n"
    "def broken(path):\n"
    "    raise ZeroDivisionError('division by zero')\n"
    "c.load_settings = broken  # a bug planted in the command\n"
    "from bubbletea.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_a_bug_says_one_line_and_shows_its_traceback_only_with_verbose() -> None:
    r = subprocess.run([sys.executable, "-c", BUG, "plan"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    one_line_error(
        r,
        "bubbletea: error: internal error: ZeroDivisionError: division by zero (a bug: rerun with -v for the "
        "traceback, and report it)",
        code=1,
    )
    for verbose in (["-v", "plan"], ["plan", "--verbose"]):
        r = subprocess.run([sys.executable, "-c", BUG, *verbose], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 1 and "Traceback" in r.stderr and "ZeroDivisionError" in r.stderr


def test_health_with_redis_down_says_so_in_one_line() -> None:
    port = free_port()  # nothing listens there
    url = f"redis://127.0.0.1:{port}/0"
    one_line_error(
        run("health", "wan_broker", env={"REDIS_URL": url}),
        f"bubbletea: error: cannot reach Redis at {url} (REDIS_URL): Error 111 connecting to 127.0.0.1:{port}. "
        f"Connect call failed ('127.0.0.1', {port}); start it (`bubbletea redis` runs one) or point REDIS_URL at a "
        "running server",
        code=1,
    )


def test_redis_refuses_a_bad_port_a_taken_port_and_a_bad_maxmemory_in_one_line() -> None:
    one_line_error(
        run("redis", "--port", "99999"),
        "bubbletea: error: argument --port: expected a port number from 1 to 65535, got '99999'",
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line_error(
            run("redis", "--port", str(port)),
            f"bubbletea: error: --port {port}: Address already in use: choose another port, or leave --port out "
            "for one",
            code=1,
        )
    one_line_error(
        run("redis", env={"BUBBLETEA_REDIS_MAXMEMORY": "lots"}),
        "bubbletea: error: BUBBLETEA_REDIS_MAXMEMORY: expected a redis-server memory size such as 512mb or 2gb, "
        "got 'lots'",
        code=1,
    )


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """`bubbletea plan | head -2`: the reader is gone before the plan is written; nothing is said."""
    p = subprocess.Popen(
        [str(BIN / "bubbletea"), "plan"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader leaves at once: the command's first write meets a closed pipe
    err = p.stderr.read()
    p.stderr.close()
    assert p.wait(timeout=60) == 141 and err == "", err  # 128 + SIGPIPE, as a coreutils tool


@pytest.mark.kernel_wan  # may bring one up as root before the Ctrl-C: one such test at a time (conftest)
@pytest.mark.parametrize("after_s", [0.5, 3.0])
def test_ctrl_c_at_any_moment_is_one_line_and_130(tmp_path: Path, after_s: float) -> None:
    """Ctrl-C while the command imports (0.5 s) and while it starts Redis and its services (3 s)."""
    p = subprocess.Popen(
        [str(BIN / "bubbletea"), "train", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    time.sleep(after_s)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err == "bubbletea: interrupted\n", err


def test_a_full_disk_under_the_run_folder_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "spec.yaml").symlink_to("/dev/full")  # every write there: ENOSPC
    one_line_error(
        run("up", "--out", str(tmp_path), "--run", "r1"),
        f"bubbletea: error: writing under {tmp_path}: No space left on device: free some space, or write elsewhere "
        "(--out DIR)",
        code=1,
    )


def test_a_service_without_redis_retries_until_the_deadline_it_states_then_exits_in_one_line() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {"REDIS_URL": url, "BUBBLETEA_REDIS_WAIT_S": "1.5", "BUBBLETEA_METRICS_PORT": "off"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("BUBBLETEA_")}
    r = subprocess.run(
        [sys.executable, "-m", "services.dispatcher"], env={**base, **env}, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert 'msg="redis unreachable; retrying with backoff until the deadline, then exiting"' in lines[-2]
    assert re.search(r"deadline=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ wait_s=1.500", lines[-2]), lines[-2]
    assert 'msg="redis still unreachable at the deadline; exiting (start Redis, or check REDIS_URL)"' in lines[-1]


def front_door(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m services.prefill_queue` as a person starts it by hand."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("BUBBLETEA_")}
    command = [sys.executable, "-m", "services.prefill_queue"]
    return subprocess.run(command, env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_a_front_door_on_a_taken_port_says_so_in_one_line(redis_server: EmbeddedRedis) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = front_door({"REDIS_URL": redis_server.url, "BUBBLETEA_HTTP_PORT": str(port)})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert 'msg="cannot listen"' in last and f"cannot listen on 127.0.0.1:{port}" in last
    assert "address already in use" in last and "BUBBLETEA_HTTP_PORT" in last


def test_a_front_door_whose_checkpoint_does_not_exist_refuses_to_start(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"datacenters: [{{name: a, gpus: 2}}]\nprefill: {{checkpoint: {tmp_path / 'nope'}}}\n")
    # no Redis needed: it refuses before waiting for one
    r = front_door({"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "BUBBLETEA_CONFIG": str(spec)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert 'msg="cannot run with this configuration"' in last and f"{tmp_path / 'nope'} does not exist" in last


def test_every_command_reads_config_then_bubbletea_config(tmp_path: Path) -> None:
    paper = {"BUBBLETEA_CONFIG": "configs/paper-scale.yaml"}
    assert run("plan", env=paper).stdout.startswith("cluster paper-scale: ")
    assert run("plan", "--config", "configs/demo.yaml", env=paper).stdout.startswith("cluster demo: ")
    r = run("check-config", env=paper)
    assert r.returncode == 0 and r.stdout.startswith("configs/paper-scale.yaml: ok (3 datacenters, 576 GPUs"), r.stderr
    assert run("check-config", "--config", "configs/demo.yaml", env=paper).stdout.startswith("configs/demo.yaml: ok")


def test_plan_check_config_and_health_print_json(redis_server: EmbeddedRedis) -> None:
    plan = json.loads(run("plan", "--json").stdout)
    assert plan["cluster"] == "demo" and plan["parallelism"] == {"pp": 2, "dp": 2, "tp": 1}
    assert set(plan["analytic"]) == {"fair", "temporal", "fifo"} and len(plan["stages"]) == 2
    check = json.loads(run("check-config", "configs/demo.yaml", "--json").stdout)
    assert check == {
        "file": "configs/demo.yaml", "ok": True, "datacenters": 2, "gpus": 4, "pp": 2, "dp": 2, "tp": 1,
        "schedule": "1f1b", "sharing": "temporal",
    }  # fmt: skip
    r = run("health", "wan_broker", "--json", env={"REDIS_URL": redis_server.url})
    assert r.returncode == 1 and json.loads(r.stdout) == {"service": "wan_broker", "live": []}


@pytest.mark.kernel_wan  # may bring one up as root before the Ctrl-C: one such test at a time (conftest)
def test_train_takes_iterations_as_up_does(tmp_path: Path) -> None:
    one_line_error(run("train", "--iterations", "0"), "bubbletea: error: --iterations must be >= 1, got 0")
    one_line_error(run("up", "--iterations", "0"), "bubbletea: error: --iterations must be >= 1, got 0")
    p = subprocess.Popen(
        [str(BIN / "bubbletea"), "train", "--iterations", "3", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert p.stdout is not None
    first = p.stdout.readline()  # "==> run train-...: PP=2 DP=2 1f1b, 3 iterations, ..."
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=120)
    assert ", 3 iterations, WAN sharing " in first, first


def test_up_refuses_a_bad_port_in_one_line() -> None:
    one_line_error(
        run("up", "--port", "99999"), "bubbletea: error: --port: expected a port number from 0 to 65535, got 99999"
    )


def test_init_model_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    one_line_error(
        run("init-model", "configs"), "bubbletea: error: configs is not empty: choose a new or empty directory"
    )
    (tmp_path / "notes.txt").write_text("mine\n")
    one_line_error(
        run("init-model", str(tmp_path)), f"bubbletea: error: {tmp_path} is not empty: choose a new or empty directory"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_directory_to_serve_needs_weights_and_init_model_weights_writes_them(tmp_path: Path) -> None:
    """check-config passes only what runs: prefill serves weights, which `init-model` alone does not
    write; the hint names the steps that do, and `init-model --weights` is one."""
    model = tmp_path / "llama"
    spec = _spec(
        tmp_path,
        "datacenters: [{name: a, gpus: 2}, {name: b, gpus: 2}]\nmodel: {seq_len: 64, seed: 0}\n"
        f"training: {{model: {model}}}\nprefill: {{checkpoint: {model}}}\n",
    )
    missing = run("check-config", str(spec))
    assert f"`bubbletea init-model {model}` makes one (add --weights to serve it too)" in missing.stderr
    assert run("init-model", str(model), "--layers", "2", "--hidden", "32").returncode == 0
    one_line_error(
        run("check-config", str(spec)),
        f"bubbletea: error: {spec}: prefill.checkpoint: {model} has no weights (model.safetensors): prefill serves a "
        f"trained model; `bubbletea train --config {spec} --save {model}` writes one, or "
        f"`bubbletea init-model {model} --weights` an untrained one",
    )
    for p in model.iterdir():
        p.unlink()
    assert run("init-model", str(model), "--layers", "2", "--hidden", "32", "--weights").returncode == 0
    assert run("check-config", str(spec)).returncode == 0
    from shared.config.spec import load_spec
    from shared.model.prefill import PrefillModel

    served = PrefillModel.from_spec(load_spec(spec).prefill)  # what the workers load: it serves
    assert served.layers == 2 and served.prefill(served.tokenizer.encode("hello")).prompt_tokens >= 1


def _spec(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


BAD_SPECS = {  # what check-config and every run command refuse, and the line they say
    "placement": (
        "datacenters: [{name: a, gpus: 2}, {name: b, gpus: 2}]\nparallelism: {pp: 4, dp: 2}\n",
        "parallelism: cannot place 4 pipeline stages of 2 GPUs each (DP=2 x TP=1, a stage's group stays inside one "
        "DC): the datacenters (a=2, b=2) fit only 2; 2 more stage(s) need 4 more GPUs in groups of 2",
    ),
    "checkpoint": (
        "datacenters: [{name: a, gpus: 2}, {name: b, gpus: 2}]\nprefill: {checkpoint: no/such/model}\n",
        "prefill.checkpoint: {dir}/no/such/model does not exist (expected a Hugging Face model directory, or a "
        "state_dict file of prefill.model's shape)",
    ),
    "duplicate": (
        "datacenters: [{name: a, gpus: 2}, {name: b, gpus: 2}]\nwan: {sharing: fair}\nname: x\nwan:\n  sharing: fifo\n",
        "duplicate key 'wan' at lines 2 and 4: the last would win",
    ),
    "training model": (
        "datacenters: [{name: a, gpus: 2}, {name: b, gpus: 2}]\ntraining: {model: no/such/dir}\n",
        "training.model: checkpoint directory {dir}/no/such/dir does not exist (nothing is ever downloaded); "
        "`bubbletea init-model {dir}/no/such/dir` makes one (add --weights to serve it too) (a relative path in a "
        "spec is read from the spec's folder, {dir})",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_check_config_refuses_what_every_run_command_refuses(tmp_path: Path, case: str) -> None:
    text, why = BAD_SPECS[case]
    spec = _spec(tmp_path, text)
    why = why.replace("{dir}", str(tmp_path))  # a relative path is read from the spec's folder
    for command in (["check-config", str(spec)], ["plan", "--config", str(spec)], ["train", "--config", str(spec)]):
        one_line_error(run(*command), f"bubbletea: error: {spec}: {why}")
    one_line_error(run("up", "--config", str(spec), "--out", str(tmp_path)), f"bubbletea: error: {spec}: {why}")


def test_check_config_and_plan_agree_on_every_spec_in_configs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process (the command itself is run as a user runs it above): 20 interpreters
    importing torch cost half a minute of the suite and pinned nothing more."""
    for var in [k for k in os.environ if k.startswith("BUBBLETEA_") or k == "REDIS_URL"]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(ROOT)
    for spec in sorted((ROOT / "configs").glob("*.yaml")):
        check = cli_main(["check-config", str(spec)]), capsys.readouterr().err
        plan = cli_main(["plan", "--config", str(spec)]), capsys.readouterr().err
        assert check[0] == plan[0], (spec, check, plan)
        if check[0]:
            assert check[1] == plan[1], spec


@pytest.mark.parametrize(
    ("var", "value", "line"),
    [
        ("BUBBLETEA_WAN", "wires", "BUBBLETEA_WAN: expected one of model, kernel, none, got 'wires'"),
        (
            "BUBBLETEA_REDIS_MAXMEMORY",
            "lots",
            "BUBBLETEA_REDIS_MAXMEMORY: expected a redis-server memory size such as 512mb or 2gb, got 'lots'",
        ),
        ("BUBBLETEA_REDIS_SERVER", "/no/redis", "BUBBLETEA_REDIS_SERVER=/no/redis is not an executable file"),
        (
            "BUBBLETEA_REDIS_WAIT_S",
            "soon",
            "BUBBLETEA_REDIS_WAIT_S: expected a number of seconds above 0 and at most 86400, got 'soon'",
        ),
    ],
)
def test_check_config_names_an_invalid_environment_variable(var: str, value: str, line: str) -> None:
    one_line_error(run("check-config", "configs/demo.yaml", env={var: value}), f"bubbletea: error: {line}")


def test_check_config_show_writes_yaml_that_loads_back_unchanged(tmp_path: Path) -> None:
    r = run("check-config", "configs/demo.yaml", "--show")
    assert r.returncode == 0 and r.stderr.startswith("configs/demo.yaml: ok (2 datacenters, 4 GPUs"), r.stderr
    shown = _spec(tmp_path, r.stdout, "shown.yaml")
    again = run("check-config", str(shown), "--show")
    assert again.returncode == 0 and again.stdout == r.stdout, again.stderr


def test_check_config_shell_prints_the_front_doors_port_for_a_batch_script() -> None:
    """What deploy/slurm/control.sbatch evals: the port in effect (BUBBLETEA_HTTP_PORT over the
    spec's), the summary on stderr, and a refused spec still one line and exit 2."""
    r = run("check-config", "configs/demo.yaml", "--shell")
    one = "DISPATCH=one\nDISPATCH_DCS=''\n"
    assert r.returncode == 0 and r.stdout == "HTTP_PORT=8000\n" + one and r.stderr.startswith("configs/demo.yaml: ok")
    r = run("check-config", "configs/demo.yaml", "--shell", env={"BUBBLETEA_HTTP_PORT": "18123"})
    assert r.returncode == 0 and r.stdout == "HTTP_PORT=18123\n" + one, r.stderr
    r = run("check-config", "configs/demo.yaml", "--shell", env={"BUBBLETEA_DISPATCH": "per_dc"})
    assert r.returncode == 0 and r.stdout == "HTTP_PORT=8000\nDISPATCH=per_dc\nDISPATCH_DCS='dc-a dc-b'\n", r.stderr
    one_line_error(
        run("check-config", "configs/demo.yaml", "--shell", "--json"),
        "bubbletea: error: --shell prints NAME=value lines alone: drop --show and --json",
    )
    bad = run("check-config", "configs/demo.yaml", "--shell", env={"BUBBLETEA_HTTP_PORT": "http"})
    assert bad.returncode == 2 and bad.stdout == "", bad.stderr


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_the_shell_completes_commands_and_options(tmp_path: Path, shell: str) -> None:
    """As `eval "$(register-python-argcomplete bubbletea)"` asks: the completions come from the parser."""
    out = tmp_path / "completions"
    line = "bubbletea pl"
    env = {"_ARGCOMPLETE": "1", "_ARGCOMPLETE_SHELL": shell, "COMP_LINE": line, "COMP_POINT": str(len(line))}
    r = run(env={**env, "_ARGCOMPLETE_IFS": "\n", "_ARGCOMPLETE_STDOUT_FILENAME": str(out)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert [c.split(":")[0].strip() for c in out.read_text().split("\n")] == ["plan"]
    line = "bubbletea check-config --sho"
    r = run(env={**env, "COMP_LINE": line, "COMP_POINT": str(len(line)), "_ARGCOMPLETE_IFS": "\n",
                 "_ARGCOMPLETE_STDOUT_FILENAME": str(out)})  # fmt: skip
    assert [c.split(":")[0].strip() for c in out.read_text().split("\n")] == ["--show"]


def test_loadgen_errors_carry_argparses_prefix_too() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    r = run("--base-url", url, "--ready-check-timeout-sec", "1", "--num-prompts", "1", tool="loadgen")
    one_line_error(
        r,
        f"loadgen: error: cannot reach the BubbleTea API at {url}: connection refused (is `bubbletea up` running?); "
        "gave up after 1s (--ready-check-timeout-sec)",
        code=1,
    )


@pytest.mark.parametrize("command", ["up", "train"])
def test_a_run_with_redis_down_says_so_in_one_line_at_once(tmp_path: Path, command: str) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    one_line_error(
        run(command, "--out", str(tmp_path), env={"REDIS_URL": url}),
        f"bubbletea: error: cannot reach Redis at {url} (REDIS_URL): Error 111 connecting to 127.0.0.1:{port}. "
        "Connection refused; start it (`bubbletea redis` runs one) or point REDIS_URL at a running server",
        code=1,
    )


async def test_drain_and_slots_say_what_is_wrong_and_count_the_slots_left(redis: Redis, redis_url: str) -> None:
    """`bubbletea drain` refuses a slot it cannot drain in one line; `bubbletea slots --live` counts
    a datacenter's slots a worker left (a drain) and nobody holds yet, and those done (what workers.sbatch asks)."""
    env = {"REDIS_URL": redis_url, "BUBBLETEA_RUN": "cli-drain"}
    one_line_error(
        await asyncio.to_thread(run, "drain", "worker-1", env=env),
        "bubbletea: error: SLOT: expected r<replica>s<stage> such as r0s1, got 'worker-1'",
    )
    one_line_error(
        await asyncio.to_thread(run, "drain", "r2s0", env=env),
        "bubbletea: error: SLOT r2s0: the spec's run has replicas 0..1 and stages 0..1 "
        "(parallelism.dp, parallelism.pp)",
    )
    one_line_error(
        await asyncio.to_thread(run, "drain", "r0s1", env=env),
        "bubbletea: error: slot r0s1 of run 'cli-drain' has no worker now (no lease): nothing to drain",
    )
    await redis.set(keys.lease_key("cli-drain", 0, 1), "w1")
    asked = await asyncio.to_thread(run, "drain", "r0s1", "--no-wait", env=env)
    assert asked.returncode == 0 and await redis.exists(keys.drain_key("cli-drain", "r0s1")), asked.stderr
    # the demo spec: stage 0 in dc-a, stage 1 in dc-b, two replicas each
    await redis.hset(keys.lease_end_key("cli-drain", 1, 1), mapping={"state": "left", "reason": "drained"})
    got = await asyncio.to_thread(run, "slots", "--dc", "dc-b", "--live", "--shell", env=env)
    assert got.stdout.split() == ["SLOTS=2", "RECOVERS=1", "LEFT=1", "DONE=0", "STOPPED=0"], got.stderr
    await redis.hset(keys.lease_end_key("cli-drain", 0, 0), mapping={"state": "done", "reason": "finished"})
    got = await asyncio.to_thread(run, "slots", "--dc", "dc-a", "--live", env=env)
    assert json.loads(got.stdout) == {"dc": "dc-a", "slots": 2, "recovers": 1, "left": 0, "done": 1, "stopped": 0}
    one_line_error(  # a slot whose worker finished training: said so, not "no worker now"
        await asyncio.to_thread(run, "drain", "r0s0", env=env),
        "bubbletea: error: slot r0s0 of run 'cli-drain' has ended (finished): nothing to drain",
    )
    one_line_error(
        await asyncio.to_thread(run, "slots", "--dc", "dc-z", env=env),
        "bubbletea: error: --dc: the spec's datacenters are dc-a, dc-b, got 'dc-z' (or set BUBBLETEA_DC)",
    )


def test_health_dc_checks_the_dispatchers_of_one_datacenter(redis_server: EmbeddedRedis) -> None:
    """`bubbletea health dispatcher --dc DC`: a dispatcher per datacenter is healthy where one of its
    own beats (its heartbeat names its datacenter), whatever the others' do."""
    r = redis_lib.Redis.from_url(redis_server.url)
    try:
        beat = {"service": "dispatcher", "instance": "d-a1", "run": "run", "dc": "dc-a", "role": "leader"}
        r.set(keys.health_key("dispatcher", "d-a1"), json.dumps(beat), ex=30)
        env = {"REDIS_URL": redis_server.url}
        ok = run("health", "dispatcher", "--dc", "dc-a", env=env)
        assert ok.returncode == 0 and ok.stdout.strip() == "dispatcher d-a1 ok"
        missing = run("health", "dispatcher", "--dc", "dc-b", env=env)
        assert missing.returncode == 1 and "no live instance serving datacenter dc-b" in missing.stderr
        assert run("health", "dispatcher", env=env).returncode == 0  # any datacenter's
    finally:
        r.delete(keys.health_key("dispatcher", "d-a1"))
        r.close()
