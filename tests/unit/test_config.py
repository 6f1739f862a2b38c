import socket
from pathlib import Path

import msgspec
import pytest
import yaml

from shared.config.deprecated import deprecated_fields, spec_builtins
from shared.config.settings import DEFAULT_SPEC, load_settings
from shared.config.spec import ConfigError, load_spec, parse_spec
from shared.model.optim import lr_at
from shared.policies.prompt_placement import Mode, mode_of

ROOT = Path(__file__).resolve().parents[2]
DC = [{"name": "a", "gpus": 4}, {"name": "b", "gpus": 2}]


def test_every_shipped_config_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Llama configs name directories the documented commands make in the checkout
    (`bubbletea init-model models/llama-tiny`, the save `runs/llama-tiny`): relative paths are read
    from the spec's folder, so they load whatever the working directory (issue 51)."""
    import shutil

    from bubbletea.initmodel import default_texts, init_model

    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "configs", checkout / "configs")
    for doc in ["README.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]:
        (checkout / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / doc, checkout / doc)
    init_model(
        checkout / "models/llama-tiny", "llama", layers=4, hidden=128, heads=4, kv_heads=2, positions=256,
        tokenizer_vocab=300, texts=default_texts()[:1],
    )  # fmt: skip
    (checkout / "runs/llama-tiny").mkdir(parents=True)
    (checkout / "runs/llama-tiny/config.json").write_text((checkout / "models/llama-tiny/config.json").read_text())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the checkout: the paths are the spec's, not the shell's
    paths = sorted((checkout / "configs").glob("*.yaml"))
    assert paths, "no configs shipped"
    for p in paths:
        spec = load_spec(p)
        assert spec.datacenters
    llama = load_spec(checkout / "configs/llama.yaml").training
    assert llama.model == str(checkout / "models/llama-tiny")
    assert llama.data is not None and all(Path(d).is_file() for d in llama.data)


def test_a_relative_path_is_read_from_the_specs_folder_and_an_error_says_which(tmp_path: Path) -> None:
    (tmp_path / "specs").mkdir()
    path = tmp_path / "specs" / "s.yaml"
    path.write_text(
        "datacenters: [{name: a, gpus: 2}, {name: b, gpus: 2}]\nprefill: {checkpoint: /abs/ckpt}\n"
        "training: {model: ../models/m, data: [a.txt]}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    said = str(info.value)
    assert f"{tmp_path / 'models/m'} does not exist" in said
    assert f"(a relative path in a spec is read from the spec's folder, {tmp_path / 'specs'})" in said


def test_demo_spec_values() -> None:
    spec = load_spec(DEFAULT_SPEC)
    assert [d.name for d in spec.datacenters] == ["dc-a", "dc-b"]
    assert spec.parallelism.pp * spec.parallelism.dp <= sum(d.gpus for d in spec.datacenters)
    assert spec.wan.sharing == "temporal"


def test_spec_is_frozen() -> None:
    spec = parse_spec({"datacenters": DC})
    with pytest.raises(AttributeError):
        spec.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"datacenters": [{"name": "a", "gpus": 0}]}, "datacenters[0].gpus: Expected `int` >= 1 (allowed: >= 1"),
        ({"datacenters": [{"name": "a", "gpu": 1}]}, "datacenters[0]: Object contains unknown field `gpu`"),
        ({"datacenters": []}, "datacenters: Expected `array` of length >= 1"),
        ({}, "(top level): Object missing required field `datacenters`"),
        ({"datacenters": DC, "wan": {"sharing": "best"}}, "wan.sharing: Invalid enum value 'best' (allowed: fair"),
        ({"datacenters": DC, "bus": {"block_ms": "x"}}, "bus.block_ms: Expected `int`, got `str`"),
        (
            {"datacenters": DC, "wan": {"default": {"bandwidth_gbps": 0}}},
            "wan.default.bandwidth_gbps: Expected `float` > 0",
        ),
        ({"datacenters": DC, "prefill": {"model": {"layers": 999}}}, "prefill.model.layers: Expected `int` <= 256"),
        ({"datacenters": DC, "model": {"d_model": 30, "heads": 4}}, "model.d_model: must be a multiple of model.heads"),
        ({"datacenters": DC, "parallelism": {"pp": 8}, "model": {"layers": 4}}, "parallelism.pp: 8 stages would leave"),
        (
            {"datacenters": DC, "parallelism": {"placement": "random"}},
            "parallelism.placement: Invalid enum value 'random' (allowed: atlas, round_robin)",
        ),
        ({"datacenters": [{"name": "a", "gpus": 1}, {"name": "a", "gpus": 1}]}, "datacenters[1].name: duplicate"),
        ({"datacenters": DC, "wan": {"links": [{"src": "a", "dst": "z"}]}}, "wan.links[0].dst: unknown datacenter 'z'"),
        ({"datacenters": DC, "wan": {"links": [{"src": "a", "dst": "a"}]}}, "wan.links[0]: src and dst are both"),
        ({"datacenters": [{"name": "Bad Name", "gpus": 1}]}, "datacenters[0].name: Expected `str` matching regex"),
        ([1, 2], "the spec must be a mapping"),
        (
            {"datacenters": DC, "device": {"prefill_us_per_token": -1}},
            "device.prefill_us_per_token: Expected `float` >= 0",
        ),
        ({"datacenters": DC, "device": {"prefill_ms_per_layer": "fast"}}, "device.prefill_ms_per_layer: Expected"),
        ({"datacenters": DC, "bubbletea": {"hold_ms": 0}}, "bubbletea.hold_ms: Expected `float` > 0"),
        ({"datacenters": DC, "decode": {"engine": "vllm"}}, "decode.vllm_url: engine vllm needs"),
        (
            {"datacenters": DC, "decode": {"engine": "vllm", "vllm_url": "http://v:8100"}, "prefill": {"kv_ttl_s": 0}},
            "needs prefill.kv_store: plane and prefill.kv_ttl_s > 0",
        ),
        ({"datacenters": DC, "decode": {"engine": "tgi"}}, "decode.engine: Invalid enum value 'tgi'"),
    ],
)
def test_bad_values_name_the_field(data: object, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_spec(data, source="x.yaml")
    assert str(err.value).startswith("x.yaml: ")
    assert expected in str(err.value)


def test_link_overrides_symmetric_and_directed() -> None:
    spec = parse_spec(
        {
            "datacenters": [*DC, {"name": "c", "gpus": 1}],
            "wan": {
                "default": {"latency_ms": 40, "connections": 4},
                "links": [
                    {"src": "a", "dst": "b", "latency_ms": 10},
                    {"src": "a", "dst": "c", "symmetric": False, "connections": 1},
                ],
            },
        }
    )
    assert spec.link("a", "b").latency_ms == 10
    assert spec.link("b", "a").latency_ms == 10
    assert spec.link("a", "c").connections == 1
    assert spec.link("c", "a").connections == 4
    assert spec.link("b", "c") == spec.wan.default


def test_load_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read cluster spec"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("datacenters: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(bad)


def test_env_overrides() -> None:
    s = load_settings(env={"REDIS_URL": "redis://h:1/0", "BUBBLETEA_HTTP_PORT": "9001", "BUBBLETEA_LOG_LEVEL": "debug"})
    assert (s.redis_url, s.spec.http.port, s.log_level) == ("redis://h:1/0", 9001, "DEBUG")
    assert s.spec.datacenters == load_spec(DEFAULT_SPEC).datacenters
    assert load_settings(env={}).redis_url is None


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"BUBBLETEA_HTTP_PORT": "http"}, "BUBBLETEA_HTTP_PORT"),
        ({"BUBBLETEA_HTTP_PORT": "70000"}, "BUBBLETEA_HTTP_PORT"),
        ({"BUBBLETEA_LOG_LEVEL": "loud"}, "BUBBLETEA_LOG_LEVEL"),
        ({"REDIS_URL": "localhost:6379"}, "REDIS_URL"),
        ({"BUBBLETEA_DECAY_ITERS": "0"}, "BUBBLETEA_DECAY_ITERS"),
        ({"BUBBLETEA_DECAY_ITERS": "soon"}, "BUBBLETEA_DECAY_ITERS"),
        ({"BUBBLETEA_ITERATIONS": "0"}, "BUBBLETEA_ITERATIONS"),
        ({"BUBBLETEA_ITERATIONS": "20000000"}, "BUBBLETEA_ITERATIONS"),
        ({"BUBBLETEA_DECODE": "yes"}, "BUBBLETEA_DECODE"),
        ({"BUBBLETEA_DECODE": "vllm"}, "decode.vllm_url"),
        ({"BUBBLETEA_TTFT_OBJECTIVE_MS": "fast"}, "BUBBLETEA_TTFT_OBJECTIVE_MS"),
        ({"BUBBLETEA_TTFT_OBJECTIVE_MS": "-5"}, "BUBBLETEA_TTFT_OBJECTIVE_MS"),
    ],
)
def test_bad_env_names_the_variable(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_settings(env=env)


def test_a_run_trained_until_stopped_keeps_the_learning_rate_horizon_it_is_given() -> None:
    """`run_training(until=...)` trains past the spec's iterations with the spec's schedule: the
    cosine still ends at the horizon given, and stays at its floor after (with no horizon a run
    that trains until stopped keeps `lr`)."""
    env = {"BUBBLETEA_ITERATIONS": "until_stopped"}
    endless = load_settings(env=env).spec.training
    kept = load_settings(env={**env, "BUBBLETEA_DECAY_ITERS": "4"}).spec.training
    assert endless.iteration_limit is None and endless.decay_iters is None and kept.decay_iters == 4
    assert lr_at(endless, 3) == endless.lr
    assert lr_at(kept, 3) < kept.lr and lr_at(kept, 9) == lr_at(kept, 4) == kept.lr * kept.min_lr_ratio


def test_decode_on_vllm_from_the_environment() -> None:
    d = load_settings(env={"BUBBLETEA_DECODE": "vllm", "BUBBLETEA_VLLM_URL": "http://v:8100"}).spec.decode
    assert (d.enabled, d.engine, d.vllm_url) == (True, "vllm", "http://v:8100")
    assert load_settings(env={"BUBBLETEA_DECODE": "on"}).spec.decode.engine == "builtin"


def test_the_ttft_objective_is_none_unless_stated_and_a_service_may_be_given_one() -> None:
    assert load_settings(env={}).spec.prefill.ttft_objective_ms is None  # the spec's default: none
    assert load_settings(env={"BUBBLETEA_TTFT_OBJECTIVE_MS": "500"}).spec.prefill.ttft_objective_ms == 500.0
    assert load_settings(env={"BUBBLETEA_TTFT_OBJECTIVE_MS": "none"}).spec.prefill.ttft_objective_ms is None


def test_the_built_in_decoder_may_compute_prompts_and_is_auto_by_default() -> None:
    """Both decoders compute prompts themselves: placement auto or decoder is a valid spec with the
    built-in one, and auto is the default wherever decode is enabled (bubbles where it is not)."""
    base = yaml.safe_load(DEFAULT_SPEC.read_text())
    for placement in ("auto", "decoder"):
        spec = parse_spec({**base, "prefill": {"placement": placement}, "decode": {"enabled": True}})
        assert spec.prefill.placement == placement and spec.decode.engine == "builtin"
    assert mode_of(None, decode_enabled=True) is Mode.AUTO
    assert mode_of(None, decode_enabled=False) is Mode.BUBBLES
    assert mode_of("bubbles", decode_enabled=True) is Mode.BUBBLES


def test_service_without_redis_url_gets_clear_error() -> None:
    with pytest.raises(ConfigError, match="REDIS_URL is not set"):
        load_settings(env={}).require_redis_url()


def test_config_reference_documents_every_field() -> None:
    """docs/config.md must mention every field of every section."""
    from shared.config import spec as config
    from shared.config import training as spec_training

    doc = (ROOT / "docs" / "config.md").read_text()
    for cls in (
        config.ClusterSpec,
        config.DataCenter,
        config.Wan,
        config.LinkParams,
        config.LinkOverride,
        spec_training.ModelSpec,
        spec_training.Parallelism,
        spec_training.Training,
        spec_training.Device,
        config.BubbleTea,
        config.Prefill,
        config.Decode,
        config.Http,
        config.BusConfig,
    ):
        for name in cls.__struct_fields__:
            assert f"`{name}`" in doc, f"{cls.__name__}.{name} is not documented in docs/config.md"
    assert msgspec.structs.fields(config.ClusterSpec)


def test_every_environment_variable_is_documented_and_read() -> None:
    from shared.config.env import ENV, ENV_VARS

    doc = (ROOT / "docs" / "config.md").read_text()
    code = "".join(p.read_text() for p in (ROOT / "shared").rglob("*.py"))
    parsed = {v.name for v in ENV if v.parse is not None}
    for var in ENV_VARS:
        assert f"`{var}`" in doc, f"{var} is not documented in docs/config.md"
        # read through its row of ENV, or else (once in ENV itself) at least once where it is read
        assert var in parsed or code.count(f'"{var}"') >= 2, f"{var} is listed in ENV_VARS but never read"


def test_up_refuses_a_bad_iteration_count_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    from bubbletea.cli import main

    assert main(["up", "--iterations", "0"]) == 2
    assert "--iterations must be >= 1, got 0" in capsys.readouterr().err


def test_secrets_are_never_logged_or_in_the_settings_repr(capsys: pytest.CaptureFixture[str]) -> None:
    from bubbletea.launcher.procs import open_redis
    from shared.config.settings import load_settings, mask_url

    assert mask_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert mask_url("redis://user:s3cret@h:1/0") == "redis://user:***@h:1/0"
    assert mask_url("rediss://tok@h:1") == "rediss://***@h:1"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    env = {"REDIS_URL": "redis://:s3cret@redis:6379/0", "BUBBLETEA_API_KEY": "k3y"}
    s = load_settings(env=env)
    assert s.redis_url == env["REDIS_URL"] and "s3cret" not in repr(s) and "k3y" not in repr(s)
    url, embedded, line = open_redis(s.redis_url, check=False)  # the line `bubbletea up`/`demo` print
    assert url == env["REDIS_URL"] and embedded is None and "s3cret" not in line and ":***@redis" in line


def test_metrics_auth_needs_an_api_key() -> None:
    from shared.config.settings import load_settings

    with pytest.raises(ConfigError, match="BUBBLETEA_API_KEY"):
        load_settings(env={"BUBBLETEA_METRICS_AUTH": "on"})
    with pytest.raises(ConfigError, match="on or off"):
        load_settings(env={"BUBBLETEA_METRICS_AUTH": "yes", "BUBBLETEA_API_KEY": "k"})
    assert load_settings(env={"BUBBLETEA_METRICS_AUTH": "on", "BUBBLETEA_API_KEY": "k"}).metrics_auth


def test_the_lease_liveness_check_is_on_unless_turned_off_and_a_typo_is_refused() -> None:
    from shared.config.settings import load_settings

    assert load_settings(env={}).lease_liveness
    assert not load_settings(env={"BUBBLETEA_LEASE_LIVENESS": "OFF"}).lease_liveness
    with pytest.raises(ConfigError, match="BUBBLETEA_LEASE_LIVENESS: expected on or off, got 'no'"):
        load_settings(env={"BUBBLETEA_LEASE_LIVENESS": "no"})


def test_the_wan_mode_defaults_to_model_and_the_environment_picks_another() -> None:
    assert load_settings(env={}).spec.wan.mode == "model"
    s = load_settings(env={"BUBBLETEA_WAN": "kernel", "BUBBLETEA_DC": "dc-b", "BUBBLETEA_PLANE_HOST": "10.0.1.5"})
    assert (s.spec.wan.mode, s.dc, s.plane_host) == ("kernel", "dc-b", "10.0.1.5")
    assert (load_settings(env={}).dc, load_settings(env={}).plane_host) == (None, "127.0.0.1")
    # auto: the address the host's name resolves to (a container's own on a Docker network)
    auto = load_settings(env={"BUBBLETEA_PLANE_HOST": "auto"}).plane_host
    assert auto == socket.gethostbyname(socket.gethostname())


def test_an_unresolvable_host_name_is_refused_for_an_auto_plane_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    with pytest.raises(ConfigError) as exc:
        load_settings(env={"BUBBLETEA_PLANE_HOST": "auto"})
    assert str(exc.value).startswith("BUBBLETEA_PLANE_HOST is 'auto', but this host's name 'no-such-host.invalid'")


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"BUBBLETEA_WAN": "tunnel"}, "BUBBLETEA_WAN: expected one of model, kernel, none, got 'tunnel'"),
        ({"BUBBLETEA_DC": "dc-z"}, "BUBBLETEA_DC: 'dc-z' is not a datacenter of the spec (it has dc-a, dc-b)"),
    ],
)
def test_a_bad_wan_setting_is_refused_naming_it(env: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(env=env)
    assert str(exc.value) == says


def test_a_spec_names_its_wan_mode_and_refuses_an_unknown_one() -> None:
    data = yaml_of(DEFAULT_SPEC)
    data["wan"]["mode"] = "none"
    assert parse_spec(data).wan.mode == "none"
    data["wan"]["mode"] = "carrier-pigeon"
    with pytest.raises(ConfigError, match="mode"):
        parse_spec(data)


def yaml_of(path: Path) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text())


def test_a_key_given_twice_is_refused_naming_both_lines_and_merges_still_load(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("datacenters:\n- name: a\n  gpus: 2\n  gpus: 4\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'gpus' at lines 3 and 4: the last would win"):
        load_spec(path)
    path.write_text("datacenters:\n- &dc {name: a, gpus: 2}\n- <<: *dc\n  name: b\n")  # an override beside a merge
    assert [dc.name for dc in load_spec(path).datacenters] == ["a", "b"]


def test_a_field_no_longer_used_loads_with_a_warning_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        spec = parse_spec({"datacenters": DC, "bubbletea": {"guard_ms": 2.0, "credit_bubbles": 2.0}}, source="x.yaml")
    assert spec.bubbletea.credit_bubbles == 2.0
    (line,) = [r.getMessage() for r in caplog.records if "no longer used" in r.getMessage()]
    assert line.startswith("x.yaml: bubbletea.guard_ms: no longer used")
    assert deprecated_fields({"datacenters": DC, "bubbletea": {"credit_bubbles": 2.0}}) == []


def test_a_spec_written_out_by_a_launcher_loads_again_with_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The demo and `bubbletea up` write each run's spec (`spec_builtins`): without the fields no
    longer used, so every service reading it starts without a deprecation warning."""
    assert "guard_ms" not in spec_builtins(parse_spec({"datacenters": DC, "bubbletea": {"guard_ms": 2.0}}))["bubbletea"]
    spec = parse_spec({"datacenters": DC})
    raw = spec_builtins(spec)
    assert deprecated_fields(raw) == []
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert parse_spec(raw) == spec  # nothing else lost
    assert not [r for r in caplog.records if "no longer used" in r.getMessage()]


def test_numbers_as_people_write_them_load_as_numbers(tmp_path: Path) -> None:
    """YAML 1.1 reads `3e-4` as a string; docs/config.md writes defaults that way (issue 51)."""
    path = tmp_path / "lr.yaml"
    path.write_text("datacenters: [{name: a, gpus: 2}]\ntraining: {lr: 3e-4, min_lr_ratio: 1E-1}\nname: 1e5x\n")
    spec = load_spec(path)
    assert spec.training.lr == pytest.approx(3e-4) and spec.training.min_lr_ratio == pytest.approx(0.1)
    assert spec.name == "1e5x"  # not a number: still a string


def test_a_yaml_error_names_the_file_line_and_column_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("datacenters:\n  - {name: a, gpus: 2\n")
    with pytest.raises(ConfigError) as info:
        load_spec(bad)
    line = str(info.value)
    assert line.startswith(f"{bad}:3:1: not valid YAML: ") and "\n" not in line and "<unicode string>" not in line


def test_an_unknown_field_names_the_one_meant_or_the_fields_there() -> None:
    with pytest.raises(ConfigError, match=r"training: Object contains unknown field `lrr` \(did you mean `lr`\?\)"):
        parse_spec({"datacenters": DC, "training": {"lrr": 0.1}})
    with pytest.raises(ConfigError, match=r"\(top level\): .*`trainng` \(did you mean `training`\?\)"):
        parse_spec({"datacenters": DC, "trainng": {}})
    with pytest.raises(ConfigError, match=r"`zzz` \(the fields there: enabled, max_batch_requests, "):
        parse_spec({"datacenters": DC, "bubbletea": {"zzz": 1}})


def test_an_unknown_bubbletea_variable_is_warned_about_with_the_one_meant() -> None:
    from shared.config.env import unknown_env

    assert unknown_env({"BUBBLETEA_ITERATION": "3", "BUBBLETEA_RUN": "r", "HOME": "/"}) == [
        "BUBBLETEA_ITERATION is not a variable BubbleTea reads; it is ignored: did you mean BUBBLETEA_ITERATIONS?"
    ]
    assert unknown_env({"BUBBLETEA_SPEC": "x", "BUBBLETEA_PROGRESS": "0"}) == []  # read by compose and the CLI
    assert unknown_env({"BUBBLETEA_HOME": "/srv/bubbletea"}) == []  # read by deploy/slurm's scripts


def test_a_spec_written_into_a_run_folder_keeps_its_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher writes the spec in effect into its run folder, and its services load it from there:
    the relative paths of the original were made absolute, so they still name the same files."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "corpus.txt").write_text("text\n")
    original = tmp_path / "configs" / "s.yaml"
    original.write_text("datacenters: [{name: a, gpus: 2}]\nprefill: {checkpoint: ../ckpt.pt}\n")
    monkeypatch.chdir(tmp_path)
    spec = load_spec(Path("configs/s.yaml"))  # a relative spec path, as `--config configs/s.yaml`
    assert spec.prefill.checkpoint == str(tmp_path / "ckpt.pt")
    written = tmp_path / "runs" / "up-1" / "spec.yaml"
    written.parent.mkdir(parents=True)
    written.write_text(yaml.safe_dump(spec_builtins(spec)))
    assert load_spec(written).prefill.checkpoint == str(tmp_path / "ckpt.pt")
