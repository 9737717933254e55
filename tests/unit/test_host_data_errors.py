"""What an operator sees for bad host data, a broken manifest or a broken inventory: every problem
of every host at once, before any connection, one line each naming the host (or file) and the key
(issues 16 and 18)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from servestack import cli
from servestack.errors import ConfigError, ManifestError
from servestack.fleet import load_inventory
from servestack.keys import BENCHMARK_KEYS, host_keys
from servestack.manifest import DEFAULT_MANIFEST, load_manifest
from servestack.preconnect import validate_targets
from servestack.settings import secret_problems, settings_from_data, validate_inventory
from servestack.strict_keys import edit_distance, foreign_key_problem
from servestack.targets import is_this_machine
from servestack.values import Invalid

ROOT = Path(__file__).resolve().parents[2]
KNOWN = host_keys(load_manifest())
USER_HINT = "(a key of your own: list it in servestack_user_keys)"


class FakeData(dict):
    def dict(self):
        return dict(self)


class FakeHost:
    def __init__(self, name, data):
        self.name, self.data = name, FakeData(data)


class FakeState:
    """The part of pyinfra's State validate_targets reads."""

    def __init__(self, hosts, limit=None):
        self.inventory, self.limit = hosts, limit

    def is_host_in_limit(self, host):
        return self.limit is None or host.name in self.limit


def refusal(data: dict, name: str = "h1") -> str:
    with pytest.raises(ConfigError) as error:
        settings_from_data(name, data)
    return str(error.value)


def manifest_without(tmp_path: Path, section: str, key: str) -> Path:
    """A copy of the shipped manifest whose [section] lacks `key`."""
    text = DEFAULT_MANIFEST.read_text()
    edited = re.sub(rf"(?ms)^(\[{re.escape(section)}\]\n(?:(?!^\[).)*?)^{re.escape(key)} = [^\n]*\n", r"\1", text)
    assert edited != text
    path = tmp_path / "stack.toml"
    path.write_text(edited)
    return path


@pytest.mark.parametrize("old, new, expected", [
    ('name = "torch"\nversion = "2.9.1+cu130"', 'name = "torch"\nversion = "2.9.1+cu128"',
     "key 'stacks.sglang-0.5.9.packages': expected torch's local label to name the stack's torch_cuda 13.0 "
     "(+cu130) or no label, got '2.9.1+cu128'"),
    ('name = "torch"\nversion = "2.9.1+cu130"', 'name = "torchx"\nversion = "2.9.1+cu130"',
     "key 'stacks.sglang-0.5.9.packages': expected a torch entry (the venv step checks its CUDA build), "
     "got ['torchx', 'torchvision', "),
])
def test_a_manifest_whose_torch_the_venv_step_cannot_force_is_refused_before_connecting(tmp_path, old, new, expected):
    """Before, these passed validation and failed when the venv step planned a release on a connected host."""
    text = DEFAULT_MANIFEST.read_text()
    assert text.count(old) == 1
    path = tmp_path / "stack.toml"
    path.write_text(text.replace(old, new))
    with pytest.raises(ConfigError) as error:
        validate_inventory([FakeHost("h1", {"servestack_manifest": str(path)})])
    lines = str(error.value).splitlines()[1:]
    assert len(lines) == 1 and lines[0].startswith(f"host h1: {path}: {expected}")


# -- strict keys (issue 18) -------------------------------------------------------------------------

@pytest.mark.parametrize("a, b, distance", [
    ("service_port", "service_port", 0), ("servce_port", "service_port", 1),
    ("sevrice_port", "service_port", 1),  # a swap of two adjacent characters is one edit
    ("srevce_port", "service_port", 2), ("kitten", "sitting", 3), ("ca", "abc", 3),  # OSA, not unrestricted DL
])
def test_edit_distance_is_optimal_string_alignment(a, b, distance):
    assert edit_distance(a, b) == distance


@pytest.mark.parametrize("key, line", [
    ("servce_port", "'servce_port': unknown key, 1 edit from 'service_port': did you mean 'service_port'?"),
    ("sevrice_port", "'sevrice_port': unknown key, 1 edit from 'service_port': did you mean 'service_port'?"),
    ("servic_prot", "'servic_prot': unknown key, 2 edits from 'service_port': did you mean 'service_port'?"),
    ("Service_Port", "'Service_Port': unknown key, 'service_port' in other letter case: did you mean 'service_port'?"),
    ("gpu_cuont", "'gpu_cuont': unknown servestack key (did you mean 'gpu_count'?)"),  # the prefix rule, kept
    ("tp", "'tp': unknown key, a servestack key without its prefix 'service_': did you mean 'service_tp'?"),
    ("port", "'port': unknown key, a servestack key without its prefix 'service_': did you mean 'service_port'?"),
    ("model_path", "'model_path': unknown key, a servestack key without its prefix 'service_': "
                   "did you mean 'service_model_path'?"),
    ("keep_releases", "did you mean 'venv_keep_releases'?"),
    ("cache_dir", "did you mean one of 'cuda_cache_dir', 'service_cache_dir', 'uv_cache_dir'?"),
    ("sglang_port", "'sglang_port': unknown key, 'sglang_' reads as servestack's 'service_': "
                    "did you mean 'service_port'?"),
    ("server_tp", "did you mean 'service_tp'?"),
    ("svc_model_path", "did you mean 'service_model_path'?"),
])
def test_a_key_that_reads_as_a_mistyped_servestack_key_is_refused(key, line):
    message = refusal({key: 1})
    assert len(message.splitlines()) == 1 and message.startswith("host h1: '" + key + "': ")
    assert line in message
    assert message.endswith("see README 'Host data'" if key.startswith("gpu_") else f"? {USER_HINT}")


def test_the_three_typos_of_the_issue_are_refused_together():
    lines = refusal({"servce_port": 30001, "tp": 4, "sglang_port": 30002}).splitlines()
    assert lines == [
        f"host h1: 'servce_port': unknown key, 1 edit from 'service_port': did you mean 'service_port'? {USER_HINT}",
        f"host h1: 'sglang_port': unknown key, 'sglang_' reads as servestack's 'service_': did you mean "
        f"'service_port'? {USER_HINT}",
        f"host h1: 'tp': unknown key, a servestack key without its prefix 'service_': did you mean 'service_tp'? "
        f"{USER_HINT}",
    ]


@pytest.mark.parametrize("key", [
    "rack", "owner", "my_team", "db_port", "app_user", "backup_path", "pip_cache_dir", "region", "tp_size",
    "test_python", "test_record",  # the integration tests' own keys
    "ssh_user", "ssh_hostname", "ssh_port", "ssh_key", "ssh_known_hosts_file", "ssh_strict_host_key_checking",
    "ssh_allow_agent", "ssh_look_for_keys", "_sudo", "_sudo_user", "_env", "_chdir", "_use_sudo_login", "name",
    "docker_identifier",
])
def test_keys_of_the_user_and_of_pyinfra_pass(key):
    assert foreign_key_problem(key, KNOWN) is None
    assert settings_from_data("h1", {key: "x"}).service_port == 30000


def test_a_key_of_the_users_own_that_looks_like_a_typo_is_declared_in_servestack_user_keys():
    assert "did you mean 'gpu_count'?" in refusal({"cpu_count": 64})
    settings = settings_from_data("h1", {"cpu_count": 64, "servestack_user_keys": ["cpu_count"]})
    assert settings.gpu_count == 8
    assert ("'servestack_user_keys': expected keys of your own, without a servestack prefix ('cuda_x' has one)"
            in refusal({"cuda_x": 1, "servestack_user_keys": ["cuda_x"]}))


@pytest.mark.parametrize(("key", "line"), [
    ("ssh_prot", "'ssh_prot': not a key pyinfra's ssh connector reads (pyinfra would ignore it): did you mean "
                 "'ssh_port'?"),
    ("ssh_usr", "did you mean 'ssh_user'?"),
    ("ssh_strict_hostkey_checking", "did you mean 'ssh_strict_host_key_checking'?"),
    ("docker_identifer", "not a key pyinfra's docker connector reads (pyinfra would ignore it): did you mean "
                         "'docker_identifier'?"),
    ("sudo", "'sudo': pyinfra reads this argument as '_sudo' and would ignore 'sudo': did you mean '_sudo'?"),
    ("sudo_user", "did you mean '_sudo_user'?"),
    ("use_sudo_login", "did you mean '_use_sudo_login'?"),
    ("_sduo", "'_sduo': unknown key, 1 edit from pyinfra's '_sudo': did you mean '_sudo'?"),
    ("_sudo_usr", "did you mean '_sudo_user'?"),
])
def test_a_near_miss_of_pyinfras_own_keys_is_refused_not_ignored(key, line):
    """pyinfra ignores a key it does not read: `ssh_prot = 2222` connected to port 22, `sudo = True` ran
    without sudo, and nothing said so."""
    message = refusal({key: 1})
    assert len(message.splitlines()) == 1 and message.startswith(f"host h1: '{key}': ")
    assert line in message and message.endswith(USER_HINT)


@pytest.mark.parametrize("key", ["timeout", "serial", "parallel", "stdin", "_my_helper", "__mirror"])
def test_names_pyinfra_shares_with_the_users_own_pass(key):
    assert foreign_key_problem(key, KNOWN) is None


def test_a_near_miss_of_pyinfras_key_that_is_the_users_own_is_declared_in_servestack_user_keys():
    assert "did you mean 'ssh_user'?" in refusal({"ssh_usr": "x"})
    assert settings_from_data("h1", {"ssh_usr": "x", "servestack_user_keys": ["ssh_usr"]}).service_port == 30000


def test_a_group_data_helper_variable_kept_as_the_readme_says_is_not_host_data(tmp_path):
    """README 'Host data': a helper variable named with two underscores, or a file with `__all__`."""
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "all.py").write_text(
        '__mirror = "http://mirror.internal"\ncuda_mirror = __mirror + "/cuda"\n')
    (tmp_path / "group_data" / "gpus.py").write_text(
        '__all__ = ["service_port"]\nbase = 30000\nservice_port = base + 1\n')
    (tmp_path / "inventory.py").write_text('gpus = ["h1"]\n')
    inventory = load_inventory(str(tmp_path / "inventory.py"))
    data = inventory.get_host("h1").data.dict()
    assert data["cuda_mirror"] == "http://mirror.internal/cuda" and data["service_port"] == 30001
    assert "__mirror" not in data and "base" not in data
    settings = settings_from_data("h1", data)
    assert settings.cuda_mirror == "http://mirror.internal/cuda" and settings.service_port == 30001


# -- every problem at once (issue 16) ---------------------------------------------------------------

def test_three_bad_values_are_three_lines_naming_host_key_and_expectation():
    lines = refusal({"service_tp": 3, "service_port": -5, "rollout_batch": 0}).splitlines()
    assert lines == [
        "host h1: 'rollout_batch': expected an integer from 1 to 1000, got 0",
        "host h1: 'service_port': expected an integer from 1 to 65535, got -5",
        "host h1: 'service_tp': expected a tensor-parallel size that divides gpu_count=8, got 3",
    ]


def test_every_hosts_problems_are_in_one_refusal_before_connecting(monkeypatch):
    monkeypatch.delenv("SERVESTACK_TEST_UNSET_SECRET", raising=False)
    hosts = [FakeHost("h1", {"service_tp": 3, "service_port": -1, "rollout_batch": 0}),
             FakeHost("h2", {}),
             FakeHost("h3", {"tp": 2, "service_secret_env": ["SERVESTACK_TEST_UNSET_SECRET"]}),
             FakeHost("h4", {"servestack_allow_local": True, "ssh_hostname": "gpu-4.example"}),
             FakeHost("localhost", {})]
    with pytest.raises(ConfigError) as error:
        validate_targets(FakeState(hosts), environ={})
    lines = str(error.value).splitlines()
    assert lines[0] == "refusing to run (nothing was changed on any host):"
    assert lines[1:] == [
        "host h1: 'rollout_batch': expected an integer from 1 to 1000, got 0",
        "host h1: 'service_port': expected an integer from 1 to 65535, got -1",
        "host h1: 'service_tp': expected a tensor-parallel size that divides gpu_count=8, got 3",
        f"host h3: 'tp': unknown key, a servestack key without its prefix 'service_': did you mean 'service_tp'? "
        f"{USER_HINT}",
        "host h3: 'service_secret_env': SERVESTACK_TEST_UNSET_SECRET is not set in the control machine's "
        "environment (export it before the run)",
        "host localhost: 'localhost' is this machine; set servestack_allow_local = True in its host data if "
        "that is really meant",
    ]


def test_service_data_no_unit_can_use_is_refused_before_connecting():
    """Before, these were refused by the service step, after connecting and reading the host."""
    hosts = [FakeHost("h1", {"service_user": "root", "service_env": {"PATH": "/tmp/evil"},
                             "service_extra_args": ["--port=9000"], "service_secret_env": ["HOME"]})]
    with pytest.raises(ConfigError) as error:
        validate_targets(FakeState(hosts), environ={"HOME": "/root"})
    assert str(error.value).splitlines()[1:] == [
        "host h1: 'service_user': expected a dedicated unprivileged user, got 'root'",
        "host h1: 'service_extra_args': --port is set from its own host-data key (see README 'Host data'), not "
        "through extra args",
        "host h1: 'service_env': PATH is pinned by servestack (CUDA 13.0.1 toolkit, per-release caches) and cannot "
        "be overridden",
        "host h1: 'service_secret_env': HOME is pinned by servestack (CUDA 13.0.1 toolkit, per-release caches) and "
        "cannot be overridden",
    ]


@pytest.mark.parametrize("address", ["127.1", "LOCALHOST", "localhost.", "::ffff:127.0.0.1", "2130706433",
                                     "0x7f.0.0.1", "127.0.0.2", "::1", "0.0.0.0", "api.localhost"])
def test_every_spelling_of_a_loopback_address_is_this_machine(address):
    hosts = [FakeHost("h1", {"ssh_hostname": address})]
    with pytest.raises(ConfigError) as error:
        validate_targets(FakeState(hosts), environ={})
    assert f"host h1: '{address}' is this machine" in str(error.value)


def test_a_name_the_hosts_file_maps_to_loopback_is_this_machine_and_others_are_not(tmp_path):
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n127.0.1.1 gpu-box.lan gpu-box  # this machine\n"
                          "# 127.0.0.1 commented-out\n10.0.0.5 gpu-01\n")
    assert is_this_machine("GPU-BOX", str(hosts_file)) and is_this_machine("gpu-box.lan", str(hosts_file))
    assert not is_this_machine("gpu-01", str(hosts_file))
    assert not is_this_machine("commented-out", str(hosts_file))
    assert not is_this_machine("198.18.0.2", str(hosts_file))
    assert not is_this_machine("gpu-02.example.com", str(hosts_file))


def test_the_pyinfra_cli_shows_a_refusal_as_its_own_error_not_as_a_line_of_servestack(tmp_path):
    """The real CLI with config.py; nothing connects (the host is loopback, refused before that)."""
    inventory = tmp_path / "inventory.py"
    inventory.write_text('hosts = [("sr", {"ssh_hostname": "127.0.0.1", "servestack_allow_local": True, '
                         '"service_user": "root"})]\n')
    pyinfra = Path(sys.executable).parent / "pyinfra"
    run = subprocess.run([str(pyinfra), str(inventory), "deploy.py", "--dry"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "--> pyinfra error: refusing to run (nothing was changed on any host):" in output
    assert "host sr: 'service_user': expected a dedicated unprivileged user, got 'root'" in output
    assert "preconnect.py" not in output and "Connecting to hosts" not in output


@pytest.mark.parametrize("deploy_file", ["deploy.py", "rollback.py"])
def test_run_from_another_directory_the_deploy_still_checks_the_inventory_before_touching_a_host(tmp_path,
                                                                                                  deploy_file):
    """pyinfra reads config.py from the current directory only: run from elsewhere, the checks ran nowhere
    and a bad inventory went on to the host. The @local host connects without touching anything; the
    deploy file then refuses the run before reading or changing it, and says how to check before connecting."""
    inventory = tmp_path / "fleet.py"
    inventory.write_text('hosts = [("@local", {"servestack_allow_local": True, "service_user": "root", '
                         '"service_prot": 30000})]\n')
    pyinfra = Path(sys.executable).parent / "pyinfra"
    run = subprocess.run([str(pyinfra), "fleet.py", str(ROOT / deploy_file), "--dry"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "pyinfra did not load servestack's config.py (it reads config.py from the current directory only)" \
        in output and f"pass --config {ROOT / 'config.py'}" in output
    assert "--> pyinfra error: refusing to run (nothing was changed on any host):" in output
    assert "host @local: 'service_user': expected a dedicated unprivileged user, got 'root'" in output
    assert "'service_prot'" in output and "Traceback" not in output and "unexpected exception" not in output


def test_a_limit_that_matches_no_host_is_refused_not_a_success(tmp_path):
    """The real CLI: a rollback whose --limit names no host of the inventory (a typo, or two names
    joined by a comma, which pyinfra does not split) must not end with exit 0 having done nothing;
    nor may a typo in one of two --limit names run on the other host alone (pyinfra only warns)."""
    inventory = tmp_path / "inventory.py"
    inventory.write_text('hosts = [("gpu-a", {"ssh_hostname": "127.0.0.1", "servestack_allow_local": True}), '
                         '("gpu-b", {"ssh_hostname": "127.0.0.1", "servestack_allow_local": True})]\n')
    expected = {("gpu-c",): "--limit gpu-c: no group or host of the inventory matches",
                ("gpu-a,gpu-b",): "--limit gpu-a,gpu-b: no group or host of the inventory is named that; a comma "
                                  "does not separate names: give --limit once per name (--limit gpu-a --limit gpu-b)",
                ("gpu-a", "gpu-x"): "--limit gpu-x: no group or host of the inventory matches"}
    for limits, line in expected.items():
        output, returncode = _pyinfra(inventory, "rollback.py", *(w for name in limits for w in ("--limit", name)))
        assert returncode == 1, output
        assert "--> pyinfra error: refusing to run (nothing was changed on any host):" in output
        assert line in output
        assert "Connecting to hosts" not in output


def test_an_inventory_file_that_does_not_exist_is_refused_before_pyinfra_reads_the_name():
    """pyinfra reads a misspelled inventory file name as a module or host name, looks it up in DNS (a path
    too long for a DNS label crashed it), and runs on no host with exit 0."""
    for missing in ("flet.py", "/tmp/servestack-no-such-dir/a-name-longer-than-a-dns-label-may-be-at-all/fleet.pyy"):
        output, returncode = _pyinfra(missing, "rollback.py")
        assert returncode == 1, output
        assert f"--> pyinfra error: {missing}: inventory file not found (in {ROOT})" in output
        assert "Loading inventory" not in output and "internal exception" not in output


def test_connection_data_pyinfra_would_stop_at_naming_no_host_is_refused_naming_the_host(tmp_path):
    """pyinfra's State.init stops at the first bad connector value with `Invalid connector data`, naming
    neither host nor file, and before the inventory's other checks: the deploy names host, key and type."""
    inventory = tmp_path / "inventory.py"
    inventory.write_text('hosts = [("gpu-a", {"ssh_hostname": "127.0.0.1", "servestack_allow_local": True, '
                         '"ssh_port": "nine"})]\n')
    output, returncode = _pyinfra(inventory, "deploy.py", "--dry")
    assert returncode == 1, output
    assert "--> pyinfra error: refusing to run (nothing was changed on any host):" in output
    assert "host gpu-a: 'ssh_port': pyinfra's SSHConnector expects int, got 'nine'" in output
    assert "Invalid connector data" not in output and "Connecting to hosts" not in output


def test_a_dry_run_says_which_group_data_applied_and_warns_of_group_data_no_host_gets(tmp_path):
    """Renaming the example's `gpu_hosts` list silently dropped group_data/gpu_hosts.py (the SSH user, sudo)."""
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "gpu_hosts.py").write_text('ssh_user = "ubuntu"\n')
    (tmp_path / "group_data" / "all.py").write_text('service_port = 30001\n')
    inventory = tmp_path / "inventory.py"
    inventory.write_text('my_gpus = [("gpu-a", {"ssh_hostname": "127.0.0.1", "servestack_allow_local": True, '
                         '"service_user": "root"})]\n')
    output, returncode = _pyinfra(inventory, "deploy.py", "--dry")
    assert returncode == 1, output   # refused (service_user root) before connecting, with the warning first
    assert "group data of 'gpu_hosts' (group_data/gpu_hosts.py) applies to no host: the inventory has no group " \
           "'gpu_hosts' (renamed?)" in output
    assert "[gpu-a] group data: all" in output and "Connecting to hosts" not in output


def test_group_data_of_a_host_in_the_order_pyinfra_applies_it(tmp_path):
    from servestack.fleet import group_data_of, unused_group_data

    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "gpu_hosts.py").write_text('ssh_user = "ubuntu"\n')
    (tmp_path / "group_data" / "spare.py").write_text('ssh_user = "spare"\n')
    inventory = tmp_path / "fleet.py"
    inventory.write_text('gpu_hosts = ["gpu-a"]\nother = ["gpu-b"]\n')
    hosts = {host.name: host for host in load_inventory(inventory)}
    assert group_data_of(hosts["gpu-a"]) == ["gpu_hosts"] and group_data_of(hosts["gpu-b"]) == []
    assert unused_group_data(hosts["gpu-a"].inventory) == [
        "group data of 'spare' (group_data/spare.py) applies to no host: the inventory has no group 'spare' "
        "(renamed?)"]


def test_an_inventory_without_hosts_is_refused():
    with pytest.raises(ConfigError, match="no host to run on: the inventory has no hosts"):
        validate_targets(FakeState([]), environ={})


def _pyinfra(inventory, deploy_file, *options) -> tuple[str, int]:
    pyinfra = Path(sys.executable).parent / "pyinfra"
    run = subprocess.run([str(pyinfra), str(inventory), deploy_file, *options, "-y"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    return run.stdout + run.stderr, run.returncode


def test_the_limit_decides_which_hosts_are_checked():
    hosts = [FakeHost("h1", {"service_port": 0}), FakeHost("h2", {})]
    validate_targets(FakeState(hosts, limit={"h2"}), environ={})


def test_hosts_of_one_run_with_different_rollout_batches_are_refused_before_connecting():
    """pyinfra runs an operation's batches with one `_parallel`: two values stopped the run at prepare,
    after connecting, with "Cannot have different values for `_parallel`" and no host or key named."""
    hosts = [FakeHost("h1", {"rollout_batch": 2}), FakeHost("h2", {}), FakeHost("h3", {"rollout_batch": 2})]
    with pytest.raises(ConfigError) as error:
        validate_targets(FakeState(hosts), environ={})
    assert str(error.value).splitlines()[1:] == [
        "'rollout_batch': the hosts of one run restart as one roll-out and need the same value, got 1 on h2; "
        "2 on h1, h3 (set it once for them all, e.g. in group_data/all.py, or --limit the run to hosts that "
        "share one)"]
    validate_targets(FakeState(hosts, limit={"h1", "h3"}), environ={})
    validate_targets(FakeState([FakeHost(name, {"rollout_batch": 3}) for name in ("h1", "h2")]), environ={})


# -- secrets named in host data (issue 16) ----------------------------------------------------------

def test_a_secret_missing_on_the_controller_is_refused_before_connecting():
    hosts = [FakeHost("h1", {"service_secret_env": ["HF_TOKEN", "EMPTY", "QUOTED", "SET"]})]
    with pytest.raises(ConfigError) as error:
        validate_targets(FakeState(hosts), environ={"EMPTY": "", "QUOTED": "it's", "SET": "hf_x"})
    assert str(error.value).splitlines()[1:] == [
        "host h1: 'service_secret_env': HF_TOKEN is not set in the control machine's environment "
        "(export it before the run)",
        "host h1: 'service_secret_env': EMPTY is set but empty in the control machine's environment",
        "host h1: 'service_secret_env': QUOTED contains a newline or a single quote, which the secrets file "
        "cannot hold",
    ]
    assert "hf_x" not in str(error.value)


def test_set_secrets_pass():
    validate_targets(FakeState([FakeHost("h1", {"service_secret_env": ["HF_TOKEN"]})]), environ={"HF_TOKEN": "t"})


def test_a_host_with_other_problems_still_has_its_secrets_checked():
    hosts = [FakeHost("h1", {"service_port": 0, "service_secret_env": ["HF_TOKEN"]})]
    with pytest.raises(ConfigError) as error:
        validate_targets(FakeState(hosts), environ={})
    assert "host h1: 'service_secret_env': HF_TOKEN is not set" in str(error.value)
    assert "host h1: 'service_port'" in str(error.value)


# -- a broken manifest (issue 18) -------------------------------------------------------------------

def test_a_manifest_missing_uv_version_is_named_by_file_and_key_for_every_run(tmp_path):
    manifest = manifest_without(tmp_path, "uv", "version")
    hosts = [FakeHost(name, {"servestack_manifest": str(manifest)}) for name in ("h1", "h2")]
    with pytest.raises(ConfigError) as error:
        validate_targets(FakeState(hosts), environ={})
    assert str(error.value).splitlines()[1:] == [
        f"hosts h1, h2: {manifest}: key 'uv.version': expected a version string like '13.0.1' (missing)"]


@pytest.mark.parametrize("section, key, expected", [
    ("service", "tp", "expected an integer from 1 to 64 (missing)"),
    ('service.profiles."kimi-k2.5-eagle3"', "model_path",
     "expected a non-empty string without whitespace or control characters (missing)"),
    ("venv", "keep_releases", "expected an integer from 1 to 100 (missing)"),
])
def test_a_manifest_missing_a_default_is_named_not_a_key_error(tmp_path, section, key, expected):
    manifest = manifest_without(tmp_path, section, key)
    with pytest.raises(ConfigError) as error:
        validate_inventory([FakeHost("h1", {"servestack_manifest": str(manifest)})])
    assert str(error.value).splitlines()[1:] == [f"host h1: {manifest}: key '{section}.{key}': {expected}"]
    with pytest.raises(ManifestError) as error:
        settings_from_data("h1", {"servestack_manifest": str(manifest)})
    assert error.value.problem == f"{manifest}: key '{section}.{key}': {expected}"


def test_a_bad_or_unknown_default_in_the_manifest_is_named(tmp_path):
    path = tmp_path / "stack.toml"
    path.write_text(DEFAULT_MANIFEST.read_text().replace("\nport = 30000\n", '\nport = "30000"\ncolour = "blue"\n'))
    with pytest.raises(ManifestError) as error:
        host_keys(load_manifest(path))
    lines = str(error.value).splitlines()
    assert lines[0] == f"{path}: key 'service.port': expected an integer from 1 to 65535, got '30000'"
    assert lines[1].startswith(f"{path}: key 'service.colour': expected one of the known keys ['health_timeout_s', ")
    assert lines[1].endswith("] (unknown key)") and len(lines) == 2


def test_servestack_keys_names_the_manifest_and_key_and_exits_2(tmp_path, capsys):
    manifest = manifest_without(tmp_path, "uv", "version")
    assert cli.main(["keys", "--manifest", str(manifest)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"servestack: {manifest}: key 'uv.version': expected a version string like '13.0.1' "
                            "(missing)\n")
    assert "Traceback" not in captured.out + captured.err


def test_servestack_keys_with_a_manifest_missing_a_service_default_exits_2(tmp_path, capsys):
    manifest = manifest_without(tmp_path, "service", "tp")
    assert cli.main(["keys", "--manifest", str(manifest)]) == 2
    assert capsys.readouterr().err == (f"servestack: {manifest}: key 'service.tp': expected an integer from 1 to 64 "
                                       "(missing)\n")


def test_servestack_keys_shows_the_shipped_manifest(capsys):
    assert cli.main(["keys"]) == 0
    assert "servestack_user_keys" in capsys.readouterr().out


def test_servestack_keys_json_lists_every_key_with_its_default(capsys):
    assert cli.main(["keys", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["manifest"] == "files/stack.toml"
    assert [row["name"] for row in document["keys"]] == list(host_keys(load_manifest(DEFAULT_MANIFEST)))
    by_name = {row["name"]: row for row in document["keys"]}
    assert by_name["service_port"]["default"] == 30000 and by_name["service_port"]["meaning"]


def test_servestack_keys_never_wraps_a_key_name_on_a_narrow_terminal(monkeypatch, capsys):
    """Read from the table, a key name broken over two lines is a key that does not exist."""
    from rich.console import Console

    from servestack import verify

    monkeypatch.setattr(verify, "report_console", lambda: Console(width=80, force_terminal=False))
    assert cli.main(["keys"]) == 0
    out = capsys.readouterr().out
    for name in ("servestack_user_keys", "service_enable_flashinfer_allreduce_fusion",
                 "service_speculative_num_draft_tokens"):
        assert any(line.split("│")[1].strip() == name for line in out.splitlines() if line.count("│") >= 3), name


# -- a broken inventory (issue 18) ------------------------------------------------------------------

# Each case has its own file name: pyinfra imports an inventory as a module of that name first.
# The hosts are placeholders, refused before any connection should the inventory load after all.
@pytest.mark.parametrize("name, inventory, group_data, expected", [
    ("inv_syntax", 'hosts = ["gpu-1.example"\n', None,
     r"^servestack: \S*inv_syntax\.py line 1: SyntaxError: '\[' was never closed$"),
    ("inv_group_data", 'hosts = ["gpu-1.example"]\n', "x = undefined_name\n",
     r"^servestack: \S*group_data/all\.py line 1: NameError: name 'undefined_name' is not defined$"),
    ("inv_raises", 'hosts = ["gpu-1.example"]\nfail = 1 / 0\n', None,
     r"^servestack: \S*inv_raises\.py line 2: ZeroDivisionError: division by zero$"),
])
def test_a_broken_inventory_is_one_line_naming_the_file_and_line(tmp_path, monkeypatch, capsys,
                                                                  name, inventory, group_data, expected):
    (tmp_path / f"{name}.py").write_text(inventory)
    if group_data:
        (tmp_path / "group_data").mkdir()
        (tmp_path / "group_data" / "all.py").write_text(group_data)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["backups", f"{name}.py"]) == 2
    err = capsys.readouterr().err
    assert re.match(expected, err.strip()), err


@pytest.mark.parametrize("name, inventory, group_data, line", [
    ("dep_syntax", 'hosts = ["gpu-1.example"\n', None, "dep_syntax.py line 1: SyntaxError: '[' was never closed"),
    ("dep_group_data", 'hosts = ["gpu-1.example"]\n', "x = undefined_name\n",
     "group_data/all.py line 1: NameError: name 'undefined_name' is not defined"),
    ("dep_raises", 'hosts = ["gpu-1.example"]\nfail = 1 / 0\n', None,
     "dep_raises.py line 2: ZeroDivisionError: division by zero"),
])
def test_the_deploy_refuses_a_broken_inventory_in_one_line_without_a_debug_log(tmp_path, name, inventory,
                                                                               group_data, line):
    """pyinfra alone printed "An internal exception occurred" with a traceback and wrote pyinfra-debug.log."""
    (tmp_path / f"{name}.py").write_text(inventory)
    if group_data:
        (tmp_path / "group_data").mkdir()
        (tmp_path / "group_data" / "all.py").write_text(group_data)
    output, returncode = _pyinfra(tmp_path / f"{name}.py", "rollback.py")
    assert returncode == 1, output
    assert re.search(r"--> pyinfra error: \S*" + re.escape(line) + "$", output.strip(), flags=re.MULTILINE), output
    assert "Traceback" not in output and "internal exception" not in output
    assert not (ROOT / "pyinfra-debug.log").exists()


def test_servestack_sh_names_the_manifest_and_key_when_uv_version_is_missing(tmp_path):
    """servestack.sh reads uv's version from the manifest before any Python of ours runs."""
    import subprocess
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "servestack.sh").read_text()
    function = script[script.index("uv_version() {"):script.index("\n}\n", script.index("uv_version() {")) + 3]
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "stack.toml").write_text('[uv]\nindex_url = "https://pypi.org/simple"\n')
    broken = subprocess.run(["bash", "-c", function + "uv_version"], cwd=tmp_path, capture_output=True, text=True)
    assert broken.returncode != 0 and "Traceback" not in broken.stderr
    assert broken.stderr.strip() == ("servestack: files/stack.toml: key 'uv.version': "
                                     "expected a version string like '0.13.9' (missing)")
    (tmp_path / "files" / "stack.toml").write_text('[uv]\nversion = "0.13.9"\n')
    fine = subprocess.run(["bash", "-c", function + "uv_version"], cwd=tmp_path, capture_output=True, text=True)
    assert fine.stdout == "0.13.9\n"


# -- upper bounds (issue 32 §6) -----------------------------------------------------------------------

@pytest.mark.parametrize(("key", "too_big", "expected"), [
    ("service_start_timeout_s", 86401, "an integer from 1 to 86400"),
    ("service_health_timeout_s", 1_800_000, "an integer from 1 to 86400"),   # milliseconds for seconds
    ("venv_keep_releases", 101, "an integer from 1 to 100"),
    ("venv_keep_backups", 1001, "an integer from 1 to 1000"),
    ("rollout_batch", 1001, "an integer from 1 to 1000"),
    ("rollout_failure_budget", 1001, "an integer from 0 to 1000"),
])
def test_every_timeout_and_count_has_an_upper_bound(key, too_big, expected):
    assert refusal({key: too_big}) == f"host h1: '{key}': expected {expected}, got {too_big}"
    settings_from_data("h1", {key: int(expected.split()[-1])})


def test_the_benchmarks_request_timeout_is_bounded_in_the_manifest():
    with pytest.raises(Invalid, match="an integer from 1 to 3600"):
        BENCHMARK_KEYS["request_timeout_s"](3601)
    assert BENCHMARK_KEYS["request_timeout_s"](3600) == 3600


# -- sglang's own choices; a bad manifest hides nothing (issue 32 §6) ------------------------------------

@pytest.mark.parametrize(("key", "value", "flag"), [
    ("service_quantization", "nvfp4", "--quantization"),
    ("service_kv_cache_dtype", "fp8", "--kv-cache-dtype"),
    ("service_attention_backend", "flashinfr", "--attention-backend"),
])
def test_a_value_the_pinned_sglang_would_refuse_at_start_is_refused_before_connecting(key, value, flag):
    """sglang's argument parser refuses these at start-up, inside the health gate's window; the choices are
    the pinned sglang's own (files/stack.toml [server_choices], tests/unit/test_real_stack.py)."""
    message = refusal({key: value})
    assert message.startswith(f"host h1: '{key}': expected one of sglang-0.5.9's {flag} choices (")
    assert message.endswith(f"), got {value!r}") and len(message.splitlines()) == 1


def test_the_choices_are_those_of_the_hosts_own_stack():
    """modelopt_mixed is sglang 0.5.14's, not 0.5.9's."""
    assert "sglang-0.5.9's --quantization choices" in refusal({"service_quantization": "modelopt_mixed"})
    glm = settings_from_data("h1", {"service_profile": "glm-5-mtp", "service_quantization": "modelopt_mixed"})
    assert glm.stack.name == "sglang-0.5.14" and glm.service_quantization == "modelopt_mixed"
    assert settings_from_data("h1", {"service_kv_cache_dtype": "fp8_e4m3"}).service_kv_cache_dtype == "fp8_e4m3"


def test_a_stack_without_server_choices_is_a_manifest_error(tmp_path):
    text = DEFAULT_MANIFEST.read_text()
    start = text.index('[stacks."sglang-0.5.9".server_choices]')
    broken = tmp_path / "stack.toml"
    broken.write_text(text[:start] + text[text.index('[[stacks."sglang-0.5.9".packages]]', start):])
    with pytest.raises(ManifestError, match=r"key 'stacks.sglang-0.5.9.server_choices': expected a table \(missing\)"):
        load_manifest(broken)


@pytest.mark.parametrize("manifest", ["/nonexistent/stack.toml", "relative/stack.toml"])
def test_a_bad_servestack_manifest_does_not_hide_the_hosts_other_problems(manifest):
    data = {"servestack_manifest": manifest, "service_port": -5, "servce_port": 1}
    lines = refusal(data).splitlines()
    assert len(lines) == 3, lines
    assert lines[0] in (f"host h1: {manifest}: manifest file not found",
                        f"host h1: 'servestack_manifest': expected an absolute path, got {manifest!r}")
    assert lines[1:] == [
        f"host h1: 'servce_port': unknown key, 1 edit from 'service_port': did you mean 'service_port'? {USER_HINT}",
        "host h1: 'service_port': expected an integer from 1 to 65535, got -5"]


def test_hosts_sharing_a_broken_manifest_get_it_once_and_each_its_own_problems():
    hosts = [FakeHost(name, {"servestack_manifest": "/nonexistent/stack.toml", **data})
             for name, data in (("h1", {"service_port": 0}), ("h2", {}))]
    with pytest.raises(ConfigError) as error:
        validate_targets(FakeState(hosts), environ={})
    lines = str(error.value).splitlines()[1:]
    assert lines == ["hosts h1, h2: /nonexistent/stack.toml: manifest file not found",
                     "host h1: 'service_port': expected an integer from 1 to 65535, got 0"], lines


# -- a group data problem is said once, naming its file (issue 30 §5) ------------------------------------

def test_a_bad_value_from_group_data_is_one_line_naming_the_group_file_not_one_per_host(tmp_path):
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "all.py").write_text("service_port = 0\n")
    (tmp_path / "group_data" / "gpus.py").write_text("service_tp = 3\n")
    (tmp_path / "inventory.py").write_text(
        'gpus = ["h1", "h2", ("h3", {"service_tp": 5})]\nothers = [("h4", {"service_port": 30001})]\n')
    with pytest.raises(ConfigError) as error:
        validate_inventory(list(load_inventory(str(tmp_path / "inventory.py"))))
    assert str(error.value).splitlines()[1:] == [
        "group all data (group_data/all.py or the inventory), hosts h1, h2, h3: 'service_port': expected an "
        "integer from 1 to 65535, got 0",
        "group gpus data (group_data/gpus.py or the inventory), hosts h1, h2: 'service_tp': expected a "
        "tensor-parallel size that divides gpu_count=8, got 3",
        "host h3: 'service_tp': expected a tensor-parallel size that divides gpu_count=8, got 5"]


def test_a_secret_named_twice_is_one_variable_and_one_line():
    """Issue 32 §6: a name listed twice in service_secret_env gave two identical lines."""
    data = {"service_secret_env": ["HF_TOKEN", "HF_TOKEN"]}
    assert secret_problems("h1", data, environ={}) == [
        "host h1: 'service_secret_env': HF_TOKEN is not set in the control machine's environment (export it "
        "before the run)"]
    assert settings_from_data("h1", data).service_secret_env == ("HF_TOKEN",)
