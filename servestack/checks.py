"""The verification checks: probe scripts that read a host in few round trips, and pure functions
that judge what they read against the host's settings.

One remote command per probe group reads everything its checks need:

    host     nvidia-smi, device nodes, nvcc, version.json, the toolkit's package, the /usr/local/cuda
             chain, servestack's records, the kept toolkits' fingerprints, the active release, the
             service's unit, process, environment (names servestack sets only) and secrets file
    python   the active venv's python: package versions, torch and its GPUs, SGLang's SM120 test
    patches  the patches step's own check of the recorded patch set (facts/patches.py)
    sample   files/verify/vector_add.cu built with the toolkit under test for the GPUs' own
             architecture, run on every GPU
    http     GET /health and a real POST /generate, from the host itself

The same check functions serve the testinfra suite (tests/verify) and the deploy's last step
(operations/verify.py). A check needing hardware the host lacks is SKIPPED with the fact that
says so; it never passes silently. Secrets never leave the host: the probe compares secret
values with the unit on the host and prints only a count, and reads only the environment
variables servestack sets from the service's process.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Callable, Mapping

from packaging.version import InvalidVersion, Version

from facts.gpu import GpuReport, gpu_command, parse_gpu_output
from facts.service import PATCH_RECORDS, UnitShow, parse_properties, release_id_of
from facts.toolkit import (Fingerprint, LinkChain, Tree, dpkg_may_own, fingerprint_command, link_chain_command,
                           parse_fingerprint, parse_json_object, parse_link_chain, parse_tree,
                           resolved_path, tree_command)
from facts.toolkit import record_path as toolkits_record_path
from operations.toolkit import kept_paths, version_json_problem
from operations.service import GENERATE_REQUEST, PINNED_ENV, check_url, release, secrets_path
from operations.service import service_environment as pinned_environment
from servestack.manifest import PROJECT_ROOT
from servestack.settings import Settings

MARK = "::servestack-verify::"
SAMPLE_SOURCE = PROJECT_ROOT / "files" / "verify" / "vector_add.cu"
GROUPS = ("host", "python", "patches", "sample", "http")

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"

# The service's live environment is read for the variables servestack pins and service_env only
# (never anything else: the secrets file's variables are in the same environment).
UNPREDICTABLE_ENV = ("SERVESTACK_PATCHSET",)  # a digest of the host's patch record


@dataclass(frozen=True)
class Outcome:
    """The verdict of one check on one host."""

    check: str
    status: str
    detail: str

    @property
    def passed(self) -> bool:
        return self.status == PASSED


def passed(check: str, detail: str) -> Outcome:
    return Outcome(check, PASSED, detail)


def failed(check: str, detail: str) -> Outcome:
    return Outcome(check, FAILED, detail)


def skipped(check: str, detail: str) -> Outcome:
    return Outcome(check, SKIPPED, detail)


# --- probe output -------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """What one probe section printed (stdout and stderr together) and its exit status."""

    rc: int | None
    text: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def lines(self) -> list[str]:
        return [line for line in self.text.splitlines() if line.strip()]

    def json(self):
        """The last line starting with MARK, decoded (python probes print their result so)."""
        for line in reversed(self.text.splitlines()):
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        return None

    def first_line(self) -> str:
        return self.lines[0].strip() if self.lines else ""


MISSING = Section(None, "")


@dataclass
class Probe:
    """The sections of one or more probe runs on one host."""

    host_name: str
    sections: dict[str, Section] = field(default_factory=dict)
    loaded: set[str] = field(default_factory=set)  # probe groups already run

    def __getitem__(self, name: str) -> Section:
        return self.sections.get(name, MISSING)

    def __contains__(self, name: str) -> bool:
        return name in self.sections


def parse_sections(text: str) -> dict[str, Section]:
    """Split probe output into sections: `MARK begin NAME` ... `MARK end NAME RC`."""
    sections, name, body = {}, None, []
    for line in text.splitlines():
        start = line.find(MARK + " ")
        if start > 0:  # output without a final newline: the marker follows it on the same line
            if name is not None:
                body.append(line[:start])
            line = line[start:]
        if line.startswith(MARK + " begin "):
            name, body = line.split()[2], []
        elif line.startswith(MARK + " end ") and name is not None:
            fields = line.split()
            rc = int(fields[3]) if len(fields) > 3 and fields[3].lstrip("-").isdigit() else None
            sections[name] = Section(rc, "\n".join(body))
            name = None
        elif name is not None:
            body.append(line)
    if name is not None:  # cut off: keep what came, with no exit status
        sections[name] = Section(None, "\n".join(body))
    return sections


# --- probe scripts ------------------------------------------------------------------------

_PRELUDE = f"""M='{MARK}'
begin() {{ printf '%s begin %s\\n' "$M" "$1"; }}
end() {{ printf '%s end %s %s\\n' "$M" "$1" "$2"; }}
"""


def _section(name: str, body: str) -> str:
    """Run `body` in a subshell, its stderr folded into stdout, framed by markers."""
    return f"begin {name}\n( {body}\n) 2>&1 </dev/null\nend {name} $?\n"


def _q(value) -> str:
    return shlex.quote(str(value))


def _replay(lines: tuple[str, ...]) -> str:
    """A command printing `lines` as they were read."""
    return f"printf '%s\\n' {' '.join(_q(line) for line in lines)}" if lines else "true"


def secrets_file(settings: Settings) -> str:
    """The service's secrets file (operations/service.py; root 0600)."""
    return secrets_path(settings)


def kept_toolkit_paths(settings: Settings) -> tuple[str, ...]:
    """The toolkits (manifest cuda.keep) that must stay as they were (the toolkit step's own list)."""
    return kept_paths(settings)


# The AWK program counts lines of the unit that contain a value of the secrets file (values of
# 4+ characters, quotes stripped); only the count leaves the host.
_SECRET_SCAN = r"""awk -v F="$1" 'BEGIN { while ((getline l < F) > 0) { if (l ~ /^[ \t]*#/) continue; i = index(l, "="); if (i == 0) continue; v = substr(l, i + 1); gsub(/^"|"$/, "", v); if (length(v) >= 4) vals[v] = 1 } } { for (v in vals) if (index($0, v)) { n++; break } } END { print n + 0 }'"""

_PACKAGE_OWNER = (
    f"n=$1; p=; if {dpkg_may_own(chr(34) + '$n' + chr(34))}; then p=$(dpkg -S \"$n\" 2>/dev/null); fi; "
    "p=${p%%\"\n\"*}; p=${p%%:*}; "  # the first line's package
    "[ -n \"$p\" ] && dpkg-query -W -f='dpkg ${Package} ${Version}\\n' \"$p\" && "
    # the toolkit's release is the version of its meta packages (cuda-nvcc is 13.0.88 in 13.0.1 and 13.0.2)
    "dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Version}\\n' cuda-toolkit-${p#cuda-nvcc-} "
    "cuda-compiler-${p#cuda-nvcc-} 2>/dev/null | sed -n 's/^ii *\\(.*\\)/dpkg-release \\1/p'; "
    "if command -v rpm >/dev/null 2>&1; then rpm -qf --qf 'rpm %{NAME} %{VERSION}-%{RELEASE}\\n' \"$n\" 2>/dev/null | "
    "grep '^rpm '; fi; "
    # A toolkit assembled from NVIDIA's pip wheels keeps their dist-info beside bin/.
    "for d in \"${n%/bin/nvcc}\"/dist-info/nvidia_cuda_nvcc-*.dist-info; do [ -d \"$d\" ] || continue; "
    "v=${d##*/nvidia_cuda_nvcc-}; echo \"wheel nvidia-cuda-nvcc ${v%.dist-info}\"; done; true"
)


# `d` = dirname of the absolute path `r` (readlink -f's answer), without starting dirname.
_PARENT = 'd=${r%/*}; d=${d:-/}'


def _property(variable: str, name: str) -> str:
    """Shell: set `variable` to property `name` of the `systemctl show` output held in $svc."""
    return (f"case \"$svc\" in {name}=*|*\"\n\"{name}=*) {variable}=${{svc#*{name}=}}; "
            f"{variable}=${{{variable}%%\"\n\"*}} ;; esac;")


def _service_sections(settings: Settings) -> list[str]:
    show = UnitShow(settings.service_name)
    names = sorted((set(PINNED_ENV) | set(settings.service_env)) - set(settings.service_secret_env))
    keep_env = _q("^(" + "|".join(names) + ")=")
    secret_names = "|".join(settings.service_secret_env)
    drop_secrets = f" | grep -Ev {_q('^(' + secret_names + ')=')}" if secret_names else ""
    name_pattern = _q("(^|[ =" + chr(34) + "])(" + secret_names + ")=")
    count_names = (f"$(printf '%s\\n' \"$u\" | grep -cE {name_pattern})" if secret_names else "0")
    return [
        _section("systemd", "test -d /run/systemd/system && echo running || echo 'not running'"),
        # systemd is asked once (the prelude, `host_script_parts`): the service section prints the
        # answer, service_process takes MainPID from it, unit_secrets the unit's files
        f"svc=${show.var}; svc_rc=${show.var}_rc\n",
        _section("service", "[ -z \"$svc\" ] || printf '%s\\n' \"$svc\"; exit $svc_rc"),
        _section("service_process",
                 f"pid=; [ $svc_rc = 0 ] && {{ {_property('pid', 'MainPID')} }}; pid=${{pid%%[!0-9]*}}; "
                 "[ -n \"$pid\" ] && [ \"$pid\" != 0 ] || exit 3; "
                 "printf 'user\\t%s\\n' \"$(stat -c %U /proc/$pid)\"; "
                 f"tr '\\0' '\\n' < /proc/$pid/environ | grep -E {keep_env}{drop_secrets} | "
                 "while IFS= read -r l; do printf 'env\\t%s\\n' \"$l\"; done"),
        # the unit as systemd reads it: its fragment and drop-ins (what `systemctl cat` prints,
        # without asking systemd a second time)
        _section("unit_secrets",
                 f"set -- {_q(secrets_file(settings))}; [ $svc_rc = 0 ] || exit 3; f=; ds=; "
                 f"{_property('f', 'FragmentPath')} {_property('ds', 'DropInPaths')} [ -n \"$f\" ] || exit 3; "
                 "u=$(set -f; cat -- \"$f\" $ds) || exit 3; "
                 f"printf 'names\\t%s\\n' \"{count_names}\"; "
                 f"if [ -r \"$1\" ]; then printf 'values\\t%s\\n' \"$(printf '%s\\n' \"$u\" | "
                 f"{_SECRET_SCAN})\"; fi"),
        _section("secrets_file", f"stat -c '%a %U %G' {_q(secrets_file(settings))} 2>/dev/null || echo absent"),
    ]


def host_script(settings: Settings, replay: Mapping[str, tuple[str, ...]] | None = None) -> str:
    """One shell script reading everything the host-group checks need.

    `replay`: sections this run already read with the same command, {"gpu": the output of
    `gpu_command()` (the deploy's preflight), "tree" / "link": the toolkit step's read}, printed
    as read instead of read again: nvidia-smi is the slowest read of all on a GPU host (it wakes
    the driver for every GPU), and the toolkit's sections start nvcc and readlink."""
    return "\n".join(host_script_parts(settings, replay))


def host_script_parts(settings: Settings, replay: Mapping[str, tuple[str, ...]] | None = None) -> tuple[str, str]:
    """`host_script` as (prelude, the rest): the prelude is the unit's `systemctl show`, the read
    the service step's UnitState fact makes too; in one probe command it runs once for both."""
    cuda = settings.cuda_install_path
    venv = _q(settings.venv_path)
    records = " ".join(PATCH_RECORDS)
    replay = replay or {}

    def read(name: str, command: str) -> str:
        return _section(name, _replay(replay[name]) if replay.get(name) else command)

    parts = [
        _PRELUDE,
        read("gpu", gpu_command()),
        _section("device_nodes", "ls -d /dev/nvidiactl /dev/nvidia[0-9]* 2>/dev/null; true"),
        read("tree", tree_command(cuda, "tree")),
        # only a toolkit without version.json is judged by its package (`version_json`): one from
        # the runfile, the common case, skips the search through the package lists
        _section("toolkit_package", f"[ -f {_q(cuda + '/version.json')} ] && exit 0; "
                                    f"set -- {_q(cuda + '/bin/nvcc')}; {_PACKAGE_OWNER}"),
        _section("toolkit_path", resolved_path(_q(cuda))),
        read("link", link_chain_command(settings.manifest.cuda["link_path"])),
        _section("record", f"cat {_q(toolkits_record_path(settings.servestack_state_dir))}"),
        *[_section(f"kept_{index}", fingerprint_command(path))
          for index, path in enumerate(kept_toolkit_paths(settings))],
        f"r=; if [ -d {venv} ]; then r=$({resolved_path(venv)}); fi\n",  # the active release's venv, for both:
        _section("release", "[ -n \"$r\" ] || exit 3; printf 'venv\\t%s\\n' \"$r\"; "
                            f"{_PARENT}; for f in {records}; do if [ -f \"$d/$f\" ]; then "
                            "printf 'record\\t%s\\n' \"$d/$f\"; fi; done"),
        # What a release's checks depend on beyond its path: its records' contents and when a package
        # was last added to or removed from its site-packages (operations/verify.py reuses results so).
        _section("release_state", "[ -n \"$r\" ] || exit 3; "
                                  "stat -c '%n %Y' \"$r\"/lib/python3*/site-packages; "
                                  f"{_PARENT}; cd \"$d\" && for f in {records}; do "
                                  "if [ -f \"$f\" ]; then sha256sum \"$f\"; fi; done; true"),
        *_service_sections(settings),
        "exit 0\n",
    ]
    return UnitShow(settings.service_name).assignment, "".join(parts)


_PYTHON_PROBE = r'''
import json, sys
import importlib.metadata as metadata
MARK, NAMES = sys.argv[1], json.loads(sys.argv[2])
out = {"executable": sys.executable, "prefix": sys.prefix, "packages": {}}
for name in NAMES:
    try:
        out["packages"][name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        out["packages"][name] = None


def error(exc):
    return f"{type(exc).__name__}: {exc}"


try:
    import torch
    info = {"version": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if info["available"]:
        count = torch.cuda.device_count()
        info["count"] = count
        info["names"] = [torch.cuda.get_device_name(i) for i in range(count)]
        info["capabilities"] = [list(torch.cuda.get_device_capability(i)) for i in range(count)]
        ops = []
        for i in range(count):
            try:
                x = torch.arange(1024, device=f"cuda:{i}", dtype=torch.float32)
                a = torch.ones(64, 64, device=f"cuda:{i}")
                ops.append({"device": i, "sum": float((x * 2).sum().item()), "matmul": float((a @ a).sum().item())})
            except Exception as exc:
                ops.append({"device": i, "error": error(exc)})
        info["ops"] = ops
    out["torch"] = info
except Exception as exc:
    out["torch_error"] = error(exc)
try:
    try:
        from sglang.srt.utils.common import is_sm120_supported
    except ImportError:
        from sglang.srt.utils import is_sm120_supported
    out["sm120"] = bool(is_sm120_supported())
except Exception as exc:
    out["sm120_error"] = error(exc)
print(MARK + json.dumps(out))
'''


def venv_python(settings: Settings) -> str:
    return f"{settings.venv_path}/bin/python"


def python_script(settings: Settings) -> str:
    """The active venv's python reports its packages, torch's view of the GPUs and SGLang's."""
    names = json.dumps([package.name for package in settings.packages])
    python = _q(venv_python(settings))
    body = (f"test -x {python} || {{ echo 'no python at '{python}; exit 127; }}\n"
            f"{python} -I -c {_q(_PYTHON_PROBE)} {_q(MARK)} {_q(names)}")
    return _PRELUDE + _section("python", body) + "exit 0\n"


def sample_script(settings: Settings) -> str:
    """Build the CUDA sample with the toolkit under test for each GPU architecture present, run it."""
    nvcc = _q(settings.cuda_install_path + "/bin/nvcc")
    work_parent = _q(settings.servestack_state_dir)
    body = (
        "test -e /dev/nvidiactl || { echo 'no /dev/nvidiactl'; exit 4; }\n"
        "caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | tr -d ' .' | sort -u)\n"
        "[ -n \"$caps\" ] || { echo 'nvidia-smi reported no compute capability'; exit 5; }\n"
        "flags=''; for c in $caps; do flags=\"$flags -gencode arch=compute_$c,code=sm_$c\"; done\n"
        # /tmp may be mounted noexec on hardened hosts: prefer servestack's state dir as root.
        f"if [ -w {work_parent} ]; then d=$(mktemp -d {work_parent}/verify-sample.XXXXXX); "
        "else d=$(mktemp -d); fi || exit 6\n"
        "cat > \"$d/vector_add.cu\" <<'SERVESTACK_SAMPLE_EOF'\n"
        f"{SAMPLE_SOURCE.read_text()}"
        "SERVESTACK_SAMPLE_EOF\n"
        f"echo \"nvcc$flags\"\n"
        f"if {nvcc} $flags -o \"$d/vector_add\" \"$d/vector_add.cu\"; then \"$d/vector_add\"; rc=$?; "
        "else echo 'nvcc failed'; rc=7; fi\n"
        "rm -rf \"$d\"; exit $rc"
    )
    return _PRELUDE + _section("sample", body) + "exit 0\n"


_HTTP_PROBE = r'''
import json, sys, urllib.error, urllib.request
MARK, BASE, REQUEST = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {"base": BASE}


def call(path, body=None, timeout=30):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(BASE + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


try:
    out["health"], _ = call("/health")
except Exception as exc:
    out["health_error"] = f"{type(exc).__name__}: {exc}"
try:
    if REQUEST is None:
        raise SystemExit(print(MARK + json.dumps(out)))
    status, text = call("/generate", REQUEST, timeout=300)
    out["generate_status"] = status
    try:
        reply = json.loads(text)
        reply = reply[0] if isinstance(reply, list) and reply else reply
        out["generate_text"] = reply.get("text") if isinstance(reply, dict) else None
    except ValueError:
        out["generate_body"] = text[:300]
except Exception as exc:
    out["generate_error"] = f"{type(exc).__name__}: {exc}"
print(MARK + json.dumps(out))
'''


# /health alone, as cheaply as the host allows (the deploy asks on every converge): bash's /dev/tcp
# starts one small program, curl loads some thirty libraries (~10 ms of a host's CPU more), Python
# more still. Each prints the same report as _HTTP_PROBE's. $1: MARK, $2: base URL, $3: address,
# $4: port. The address is the host's own (check_url): loopback needs no connect timeout; another
# of its addresses might sit behind a firewall that drops, so coreutils' timeout bounds it. When
# bash cannot connect (a refused connection, or a bash built without /dev/tcp) it exits
# BASH_NO_CONNECTION without a report, and curl (or Python) asks and says why.
BASH_NO_CONNECTION = 100  # the exit status of _BASH_HEALTH's failed connect
_BASH_HEALTH = r"""trap '' PIPE
exec 3<>"/dev/tcp/$3/$4" || exit 100
printf 'GET /health HTTP/1.0\r\nHost: %s\r\n\r\n' "$3" >&3
IFS=' ' read -t 30 -r proto code rest <&3; rc=$?
if [[ $proto == HTTP/* && $code == [1-9][0-9][0-9] ]]; then printf '%s{"base": "%s", "health": %s}\n' "$1" "$2" "$code"
elif [ $rc -gt 128 ]; then printf '%s{"base": "%s", "health_error": "no answer within 30 s"}\n' "$1" "$2"
else printf '%s{"base": "%s", "health_error": "no HTTP status line in the answer"}\n' "$1" "$2"; fi"""

_CURL_HEALTH = r"""code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 30 "$2/health"); rc=$?
case "$rc:$code" in
  0:[1-9][0-9][0-9]) printf '%s{"base": "%s", "health": %s}\n' "$1" "$2" "$code" ;;
  7:*) printf '%s{"base": "%s", "health_error": "connection refused (curl exit 7)"}\n' "$1" "$2" ;;
  28:*) printf '%s{"base": "%s", "health_error": "no answer within 30 s (curl exit 28)"}\n' "$1" "$2" ;;
  *) printf '%s{"base": "%s", "health_error": "curl exit %s, HTTP code %s"}\n' "$1" "$2" "$rc" "$code" ;;
esac"""


def _health_address(url: str) -> tuple[str, str]:
    """(address, port) of check_url's `http://<address>:<port>` (an IPv6 address without brackets)."""
    address, _, port = url.removeprefix("http://").rpartition(":")
    return address.strip("[]"), port


def http_script(settings: Settings, generate: bool = True) -> str:
    """Ask the service for /health and (unless `generate` is False) a real /generate, from the host itself."""
    python = _q(venv_python(settings))
    url = check_url(settings)
    request = _q(json.dumps(GENERATE_REQUEST if generate else None))
    body = (f"p={python}; test -x \"$p\" || p=python3\n"
            f"\"$p\" -I -c {_q(_HTTP_PROBE)} {_q(MARK)} {_q(url)} {request}")
    if not generate:
        address, port = _health_address(url)
        with_bash = "command -v bash >/dev/null 2>&1"
        bash = f"bash -c {_q(_BASH_HEALTH)} bash \"$@\" 2>/dev/null; r=$?"
        if address not in ("127.0.0.1", "::1"):
            with_bash += " && command -v timeout >/dev/null 2>&1"
            bash = (f"timeout 35 {bash}; [ $r != 124 ] || "
                    "printf '%s{\"base\": \"%s\", \"health_error\": \"no answer within 35 s\"}\\n' \"$1\" \"$2\"")
        body = (f"set -- {_q(MARK)} {_q(url)} {_q(address)} {_q(port)}\nr={BASH_NO_CONNECTION}\n"
                f"if {with_bash}; then {bash}; fi\n"
                f"if [ $r != {BASH_NO_CONNECTION} ]; then :\n"
                f"elif command -v curl >/dev/null 2>&1; then\n{_CURL_HEALTH}\nelse {body}\nfi")
    return _PRELUDE + _section("http", body) + "exit 0\n"


def patches_script(settings: Settings, record_path: str | None) -> str:
    """The patches step's own read-only check of the active release's patch set (facts/patches.py)."""
    from facts.patches import PATCH_ROOT, remote_command

    command = remote_command(venv_python(settings), "check", "sglang", record_path, PATCH_ROOT, memo=False)
    return _PRELUDE + "begin patches\n{\n" + command + "\n} 2>&1\nend patches $?\nexit 0\n"


SCRIPTS: dict[str, Callable[[Settings], str]] = {
    "host": host_script, "python": python_script, "sample": sample_script, "http": http_script,
}


# --- reading sections ---------------------------------------------------------------------


def parse_tabbed(text: str) -> dict[str, list[str]]:
    """'key<TAB>value' lines into {key: [values]}."""
    pairs: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, tab, value = line.partition("\t")
        if tab:
            pairs.setdefault(key, []).append(value)
    return pairs


def gpu_report(probe: Probe) -> GpuReport:
    return parse_gpu_output(probe["gpu"].text.splitlines())


def toolkit_tree(settings: Settings, probe: Probe) -> Tree:
    return parse_tree(settings.cuda_install_path, probe["tree"].text.splitlines(), "tree")


def link_chain(settings: Settings, probe: Probe) -> LinkChain:
    link = settings.manifest.cuda["link_path"]
    return parse_link_chain(link, probe["link"].text.splitlines())


def toolkits_record(probe: Probe) -> dict | None:
    section = probe["record"]
    return parse_json_object(section.text) if section.ok else None


def release_paths(probe: Probe) -> tuple[str | None, list[str]]:
    """(the active venv's real path, the patch records found beside it)."""
    values = parse_tabbed(probe["release"].text)
    return (values.get("venv") or [None])[0], values.get("record", [])


def patch_record_for(probe: Probe) -> str | None:
    """The record the patches step wrote for the active release: `<release>/patches.json`
    (docs/design.md) when present, else the step's default `<venv>/servestack-patches.json` (None)."""
    venv, records = release_paths(probe)
    designed = [path for path in records if path.endswith("/" + PATCH_RECORDS[0])]
    return designed[0] if designed else None


def major_minor(version: str) -> str:
    release = Version(version).release
    return f"{release[0]}.{release[1] if len(release) > 1 else 0}"


def _version(text: str | None) -> Version | None:
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def _on(probe: Probe) -> str:
    return f"on {probe.host_name}"


# --- GPU ----------------------------------------------------------------------------------


def _gpus_or_skip(check: str, probe: Probe):
    report = gpu_report(probe)
    if report.gpus:
        return report.gpus
    return skipped(check, f"no NVIDIA driver answers {_on(probe)}: {report.error}")


def driver_version(settings: Settings, probe: Probe) -> Outcome:
    check = "driver_version"
    gpus = _gpus_or_skip(check, probe)
    if isinstance(gpus, Outcome):
        return gpus
    minimum = settings.manifest.cuda["min_driver"]
    drivers = sorted({gpu.driver_version for gpu in gpus})
    low = [driver for driver in drivers if (_version(driver) or Version("0")) < Version(minimum)]
    if low:
        return failed(check, f"driver {', '.join(drivers)} {_on(probe)} is older than the manifest minimum "
                             f"{minimum} (CUDA {settings.cuda_version} needs it)")
    return passed(check, f"driver {', '.join(drivers)} >= {minimum}")


def gpu_capability(settings: Settings, probe: Probe) -> Outcome:
    check = "gpu_capability"
    gpus = _gpus_or_skip(check, probe)
    if isinstance(gpus, Outcome):
        return gpus
    expected = settings.gpu_compute_capability
    wrong = [f"{gpu.describe()} reports {gpu.compute_cap}" for gpu in gpus if gpu.compute_cap != expected]
    if wrong:
        return failed(check, f"expected compute capability {expected} {_on(probe)}: " + "; ".join(wrong))
    return passed(check, f"{len(gpus)} GPU(s) report compute capability {expected}")


def gpu_count(settings: Settings, probe: Probe) -> Outcome:
    check = "gpu_count"
    gpus = _gpus_or_skip(check, probe)
    if isinstance(gpus, Outcome):
        return gpus
    if len(gpus) != settings.gpu_count:
        return failed(check, f"nvidia-smi lists {len(gpus)} GPU(s) {_on(probe)}, host data gpu_count is "
                             f"{settings.gpu_count}")
    return passed(check, f"{len(gpus)} GPU(s), as gpu_count says")


# --- toolkit ------------------------------------------------------------------------------


def nvcc_version(settings: Settings, probe: Probe) -> Outcome:
    check = "nvcc_version"
    nvcc = f"{settings.cuda_install_path}/bin/nvcc"
    tree = toolkit_tree(settings, probe)
    expected = settings.manifest.cuda["nvcc_version"]
    if not tree.exists:
        return failed(check, f"{settings.cuda_install_path} does not exist {_on(probe)}")
    if tree.nvcc is None:
        return failed(check, f"{nvcc} {_on(probe)}: {tree.nvcc_error or 'no version reported'}")
    if tree.nvcc.version != expected:
        return failed(check, f"{nvcc} reports V{tree.nvcc.version}, the manifest pins V{expected} "
                             f"(CUDA {settings.cuda_version})")
    return passed(check, f"{nvcc} reports release {tree.nvcc.release}, V{tree.nvcc.version}")


def _package_owner(probe: Probe) -> tuple[str, str, str] | None:
    """(manager, package, version) of the package owning the toolkit's nvcc, or None."""
    for line in probe["toolkit_package"].lines:
        fields = line.split()
        if len(fields) == 3 and fields[0] in ("dpkg", "rpm", "wheel"):
            return fields[0], fields[1], fields[2]
    return None


def _packaged_release(probe: Probe) -> str | None:
    """'cuda-compiler-13-0 13.0.2-1': the meta package giving a packaged toolkit's release."""
    releases = [line.split(maxsplit=1)[1] for line in probe["toolkit_package"].lines
                if line.startswith("dpkg-release ")]
    return releases[0] if releases else None


def version_json(settings: Settings, probe: Probe) -> Outcome:
    """version.json agrees with the manifest (the toolkit step's own judgement). A toolkit from
    distribution packages has none: its nvcc package must agree with the manifest's nvcc version,
    and since that version is shared by toolkit releases (13.0.1, 13.0.2), it passes only where host
    data accepts an existing toolkit (cuda_existing_toolkit = 'accept'), as the toolkit step does."""
    check = "version_json"
    path = f"{settings.cuda_install_path}/version.json"
    expected_nvcc = settings.manifest.cuda["nvcc_version"]
    tree = toolkit_tree(settings, probe)
    if not tree.exists:
        return failed(check, f"{settings.cuda_install_path} does not exist {_on(probe)}")
    if tree.version_json_invalid:
        return failed(check, f"{path} {_on(probe)} is not valid JSON")
    if tree.version_json is not None:
        problem = version_json_problem(settings, tree.version_json)
        if problem:
            return failed(check, f"{path} {_on(probe)}: {problem}")
        return passed(check, f"{path}: CUDA {tree.version_json['cuda']['version']}, cuda_nvcc {expected_nvcc}")
    owner = _package_owner(probe)
    if owner is None:
        return failed(check, f"{path} is missing {_on(probe)} and no package owns the toolkit's nvcc")
    manager, package, package_version = owner
    release = _packaged_release(probe)
    found = f"{manager} package {package} {package_version}" + (f", release {release}" if release else "")
    if package_version.split("-")[0] != expected_nvcc:
        return failed(check, f"{path} is missing {_on(probe)}: a toolkit from {found}; the manifest pins nvcc "
                             f"{expected_nvcc}")
    if settings.cuda_existing_toolkit != "accept":
        return failed(check, f"{path} is missing {_on(probe)}: a toolkit from {found}, which cannot be confirmed "
                             f"as CUDA {settings.cuda_version} (its nvcc {expected_nvcc} is shared by other "
                             "releases); host data cuda_existing_toolkit = 'accept' accepts it")
    return passed(check, f"no version.json: toolkit from {found}; nvcc {expected_nvcc} as pinned, accepted "
                         "(cuda_existing_toolkit = 'accept')")


def kept_toolkits(settings: Settings, probe: Probe) -> Outcome:
    """Every kept toolkit (manifest cuda.keep) has the fingerprint recorded before the install
    (facts/toolkit.py's fingerprint, the one the toolkit step records)."""
    check = "kept_toolkits"
    record = toolkits_record(probe)
    record_file = toolkits_record_path(settings.servestack_state_dir)
    if record is None:
        return failed(check, f"no readable {record_file} {_on(probe)}: the toolkit step records the kept "
                             "toolkits' fingerprints there before installing")
    problems, notes = [], []
    for index, path in enumerate(kept_toolkit_paths(settings)):
        recorded = (record.get("toolkits") or {}).get(path)
        if not isinstance(recorded, dict):
            problems.append(f"{record_file} has no fingerprint of {path}")
            continue
        before = Fingerprint.from_record(path, recorded)
        now = parse_fingerprint(path, probe[f"kept_{index}"].text.splitlines())
        changes = before.differences(now)
        if changes:
            problems.append(f"{path} changed since it was recorded: " + "; ".join(changes))
        else:
            notes.append(f"{path} " + (f"unchanged ({now.files} files, nvcc {now.nvcc_version})" if now.present
                                       else "absent, as recorded"))
    if problems:
        return failed(check, f"{_on(probe)}: " + "; ".join(problems))
    return passed(check, "; ".join(notes) or "no toolkit to keep")


def cuda_link(settings: Settings, probe: Probe) -> Outcome:
    """/usr/local/cuda resolves where cuda_link_policy says: to the new toolkit ('new') or where it
    resolved before the install ('keep', from toolkits.json). A chain through /etc/alternatives
    counts by where it ends."""
    check = "cuda_link"
    chain = link_chain(settings, probe)
    if settings.cuda_link_policy == "new":
        target = probe["toolkit_path"].first_line() or settings.cuda_install_path
        if chain.resolved != target:
            return failed(check, f"cuda_link_policy 'new': {chain.path} should resolve to {target} {_on(probe)}, "
                                 f"but is {chain.describe()}")
        return passed(check, f"{chain.describe()} (policy 'new')")
    record = toolkits_record(probe)
    if not record or not isinstance(record.get("link"), dict):
        return failed(check, f"cuda_link_policy 'keep': {toolkits_record_path(settings.servestack_state_dir)} "
                             f"{_on(probe)} has no record of where {chain.path} pointed before the install")
    before = LinkChain.from_record(record["link"])
    if chain.resolved != before.resolved:
        return failed(check, f"cuda_link_policy 'keep': {chain.path} was {before.describe()} before the install, "
                             f"now {chain.describe()} {_on(probe)}")
    return passed(check, f"{chain.describe()}, as before the install (policy 'keep')")


def _sample_results(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("device ", "devices "))]


def cuda_sample(settings: Settings, probe: Probe) -> Outcome:
    check = "cuda_sample"
    section = probe["sample"]
    if section.rc == 4:
        return skipped(check, f"no /dev/nvidiactl {_on(probe)}: no GPU device the CUDA runtime could open")
    if section.rc is None:
        return failed(check, f"the CUDA sample did not finish {_on(probe)}")
    flags = next((line for line in section.lines if line.startswith("nvcc ")), "nvcc")
    if section.rc == 7:
        return failed(check, f"{settings.cuda_install_path}/bin/{flags} failed {_on(probe)}:\n"
                             + "\n".join(section.lines[-15:]))
    results = _sample_results(section.text)
    if section.rc != 0 or not results or not results[-1].endswith("PASS"):
        detail = "\n".join(results or section.lines[-15:])
        return failed(check, f"the CUDA sample built with `{flags}` failed {_on(probe)} (exit {section.rc}):\n"
                             f"{detail}")
    return passed(check, f"built with `{flags}`; " + "; ".join(results))


# --- release ------------------------------------------------------------------------------


def _python_report(probe: Probe) -> dict | None:
    try:
        report = probe["python"].json()
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _no_python_report(check: str, settings: Settings, probe: Probe) -> Outcome:
    section = probe["python"]
    return failed(check, f"{venv_python(settings)} {_on(probe)} gave no report (exit {section.rc}): "
                         + "\n".join(section.lines[-10:]))


def package_version(settings: Settings, probe: Probe, name: str) -> Outcome:
    """The active release holds the manifest's exact version, local label included."""
    check = f"package_version[{name}]"
    report = _python_report(probe)
    if report is None:
        return _no_python_report(check, settings, probe)
    expected = settings.manifest.package(name).version
    found = report["packages"].get(name)
    where = report.get("prefix") or settings.venv_path
    if found is None:
        return failed(check, f"{name} is not installed in {where} {_on(probe)}, expected {expected}")
    if _version(found) != Version(expected) or found.partition("+")[2] != expected.partition("+")[2]:
        return failed(check, f"{name} {found} in {where} {_on(probe)}, expected {expected}")
    return passed(check, f"{name} {found}")


def _torch(check: str, settings: Settings, probe: Probe):
    report = _python_report(probe)
    if report is None:
        return _no_python_report(check, settings, probe)
    if "torch" not in report:
        return failed(check, f"torch does not import in {report.get('prefix')} {_on(probe)}: "
                             f"{report.get('torch_error')}")
    return report["torch"]


def _torch_gpu(check: str, settings: Settings, probe: Probe):
    torch = _torch(check, settings, probe)
    if isinstance(torch, Outcome) or torch["available"]:
        return torch
    return skipped(check, f"torch.cuda.is_available() is False {_on(probe)}")


def torch_cuda_build(settings: Settings, probe: Probe) -> Outcome:
    check = "torch_cuda_build"
    torch = _torch(check, settings, probe)
    if isinstance(torch, Outcome):
        return torch
    expected = major_minor(settings.cuda_version)
    if torch["cuda"] != expected:
        return failed(check, f"torch {torch['version']} {_on(probe)} is built for CUDA {torch['cuda']}, "
                             f"expected {expected}")
    return passed(check, f"torch {torch['version']}, torch.version.cuda == {expected!r}")


def torch_device_capability(settings: Settings, probe: Probe) -> Outcome:
    check = "torch_device_capability"
    torch = _torch_gpu(check, settings, probe)
    if isinstance(torch, Outcome):
        return torch
    expected = [int(part) for part in settings.gpu_compute_capability.split(".")]
    capabilities = torch["capabilities"]
    wrong = [f"cuda:{i} is {tuple(cap)}" for i, cap in enumerate(capabilities) if cap != expected]
    if wrong or len(capabilities) != settings.gpu_count:
        return failed(check, f"expected {settings.gpu_count} device(s) of capability {tuple(expected)} "
                             f"{_on(probe)}, torch sees {len(capabilities)}"
                             + (": " + "; ".join(wrong) if wrong else ""))
    return passed(check, f"{len(capabilities)} device(s), each {tuple(expected)}")


def torch_cuda_op(settings: Settings, probe: Probe) -> Outcome:
    check = "torch_cuda_op"
    torch = _torch_gpu(check, settings, probe)
    if isinstance(torch, Outcome):
        return torch
    expected_sum, expected_matmul = float(2 * sum(range(1024))), float(64 ** 3)
    problems = []
    for op in torch.get("ops", []):
        if "error" in op:
            problems.append(f"cuda:{op['device']}: {op['error']}")
        elif (op["sum"], op["matmul"]) != (expected_sum, expected_matmul):
            problems.append(f"cuda:{op['device']}: sum {op['sum']} (expected {expected_sum}), "
                            f"matmul {op['matmul']} (expected {expected_matmul})")
    if problems or not torch.get("ops"):
        return failed(check, f"torch CUDA operations {_on(probe)}: " + ("; ".join(problems) or "no device ran"))
    return passed(check, f"a sum and a matmul on {len(torch['ops'])} device(s) gave the right results")


def sglang_sm120(settings: Settings, probe: Probe) -> Outcome:
    check = "sglang_sm120"
    if not settings.gpu_compute_capability.startswith("12."):
        return skipped(check, f"the expected compute capability {settings.gpu_compute_capability} {_on(probe)} "
                              "is not SM120")
    torch = _torch_gpu(check, settings, probe)
    if isinstance(torch, Outcome):
        return torch
    report = _python_report(probe)
    if "sm120" not in report:
        return failed(check, f"SGLang's is_sm120_supported() {_on(probe)} raised: {report.get('sm120_error')}")
    if not report["sm120"]:
        return failed(check, f"SGLang's is_sm120_supported() is False {_on(probe)} (torch {torch['version']}, "
                             f"CUDA {torch['cuda']}, capabilities {torch['capabilities']})")
    return passed(check, "SGLang's is_sm120_supported() is True")


def patches_applied(settings: Settings, probe: Probe) -> Outcome:
    """The recorded patch set is applied and every patched file is as the record says: the patches
    step's own check (facts/patches.py) finds each patch applied and its record current."""
    check = "patches_applied"
    section = probe["patches"]
    report = parse_json_object(section.lines[-1]) if section.lines else None
    if report is None:
        return failed(check, f"the patch check {_on(probe)} gave no report (exit {section.rc}): "
                             + "\n".join(section.lines[-10:]))
    if not report.get("installed"):
        what = "no python" if report.get("python_missing") else "sglang is not installed"
        return failed(check, f"{what} at {report.get('python')} {_on(probe)}")
    if report.get("patch_set") is None:
        return passed(check, f"sglang {report['version']} has no patch set")
    not_applied = [f"{patch['name']} is {patch['state']}" for patch in report["patches"]
                   if patch["state"] not in ("applied", "upstream")]
    if not_applied:
        return failed(check, f"sglang {report['version']} {_on(probe)}: " + "; ".join(not_applied))
    if report.get("record") != "current":
        return failed(check, f"the patch record {report.get('record_path')} {_on(probe)} is {report.get('record')}: "
                             "the patched files are not what the patches step recorded")
    return passed(check, f"sglang {report['version']}: "
                         + ", ".join(f"{patch['name']} {patch['state']}" for patch in report["patches"])
                         + f"; record {report.get('record_path')} current")


# --- service ------------------------------------------------------------------------------


def _systemd_or_skip(check: str, probe: Probe) -> Outcome | None:
    if probe["systemd"].first_line() != "running":
        return skipped(check, f"systemd is not running {_on(probe)} (no /run/systemd/system)")
    return None


def service_active(settings: Settings, probe: Probe) -> Outcome:
    check = "service_active"
    skip = _systemd_or_skip(check, probe)
    if skip:
        return skip
    props = parse_properties(probe["service"].text.splitlines())
    unit = settings.service_name
    if props.get("LoadState") != "loaded":
        return failed(check, f"{unit} is not installed {_on(probe)} (LoadState={props.get('LoadState')})")
    state = (f"UnitFileState={props.get('UnitFileState')}, "
             f"ActiveState={props.get('ActiveState')}/{props.get('SubState')}")
    if props.get("UnitFileState") != "enabled" or props.get("ActiveState") != "active":
        return failed(check, f"{unit} {_on(probe)} must be enabled and active: {state}")
    return passed(check, f"{unit} enabled and active (MainPID {props.get('MainPID')})")


def _service_process(check: str, settings: Settings, probe: Probe):
    skip = _systemd_or_skip(check, probe)
    if skip:
        return skip
    section = probe["service_process"]
    if not section.ok:
        return failed(check, f"{settings.service_name} has no running main process {_on(probe)}")
    return parse_tabbed(section.text)


def service_user(settings: Settings, probe: Probe) -> Outcome:
    check = "service_user"
    process = _service_process(check, settings, probe)
    if isinstance(process, Outcome):
        return process
    user = (process.get("user") or ["?"])[0]
    if user != settings.service_user:
        return failed(check, f"{settings.service_name}'s process runs as {user} {_on(probe)}, "
                             f"expected {settings.service_user}")
    return passed(check, f"{settings.service_name} runs as {user}")


def _path_entries(value: str | None) -> list[str]:
    return [entry.rstrip("/") for entry in (value or "").split(":") if entry]


_TOOLKIT_DIR = re.compile(r"/cuda(-\d+(\.\d+)*)?(/|$)")


def _other_toolkit(entry: str, cuda: str) -> bool:
    """A search-path entry inside a CUDA toolkit other than `cuda`."""
    return bool(_TOOLKIT_DIR.search(entry)) and entry != cuda and not entry.startswith(cuda + "/")


def _pinned_for_active_release(settings: Settings, probe: Probe) -> dict[str, str] | None:
    """What the service step pins for the active release (operations/service.py), or None."""
    venv, _ = release_paths(probe)
    release_id = release_id_of(venv, settings.venv_releases_dir)
    if release_id is None:
        return None
    expected = dict(pinned_environment(settings, release(settings, release_id), None))
    return {name: value for name, value in expected.items()
            if name not in UNPREDICTABLE_ENV and name not in settings.service_secret_env}


def service_environment(settings: Settings, probe: Probe) -> Outcome:
    """The live process carries the pinned CUDA environment: CUDA_HOME is the new toolkit, its bin/
    and libraries are on PATH and LD_LIBRARY_PATH, no other toolkit is (not even /usr/local/cuda,
    which may point elsewhere), and every variable the service step pins for the active release
    (caches, service_env, SERVESTACK_RELEASE) has its value: the service runs what is active."""
    check = "service_environment"
    process = _service_process(check, settings, probe)
    if isinstance(process, Outcome):
        return process
    env = dict(item.split("=", 1) for item in process.get("env", []) if "=" in item)
    cuda = settings.cuda_install_path
    problems = []
    if env.get("CUDA_HOME", "").rstrip("/") != cuda:
        problems.append(f"CUDA_HOME is {env.get('CUDA_HOME')!r}, expected {cuda!r}")
    path, libraries = _path_entries(env.get("PATH")), _path_entries(env.get("LD_LIBRARY_PATH"))
    if f"{cuda}/bin" not in path:
        problems.append(f"PATH lacks {cuda}/bin")
    if not any(entry.startswith(cuda + "/") for entry in libraries):
        problems.append(f"LD_LIBRARY_PATH has no {cuda} library directory")
    strays = sorted({entry for entry in path + libraries if _other_toolkit(entry, cuda)})
    if strays:
        problems.append("another toolkit is on the search paths: " + ", ".join(strays))
    expected = _pinned_for_active_release(settings, probe)
    if expected is None:
        problems.append(f"{settings.venv_path} is not a release under {settings.venv_releases_dir}")
    else:
        problems += [f"{name} is {env.get(name)!r}, the service step pins {value!r}"
                     for name, value in expected.items() if env.get(name) != value]
    if problems:
        return failed(check, f"{settings.service_name}'s live environment {_on(probe)}: " + "; ".join(problems))
    return passed(check, f"CUDA_HOME={cuda}; no other toolkit on PATH or LD_LIBRARY_PATH; "
                         f"{len(expected)} pinned variable(s) as the service step sets them")


def _http_report(check: str, probe: Probe):
    skip = _systemd_or_skip(check, probe)
    if skip:
        return skip
    try:
        report = probe["http"].json()
    except ValueError:
        report = None
    if not isinstance(report, dict):
        return failed(check, f"the HTTP probe {_on(probe)} gave no report: " + "\n".join(probe["http"].lines[-10:]))
    return report


def service_health(settings: Settings, probe: Probe) -> Outcome:
    check = "service_health"
    report = _http_report(check, probe)
    if isinstance(report, Outcome):
        return report
    url = f"{report['base']}/health"
    if report.get("health") != 200:
        return failed(check, f"GET {url} {_on(probe)}: {report.get('health') or report.get('health_error')}")
    return passed(check, f"GET {url}: 200")


def service_generate(settings: Settings, probe: Probe) -> Outcome:
    check = "service_generate"
    report = _http_report(check, probe)
    if isinstance(report, Outcome):
        return report
    url = f"{report['base']}/generate"
    text = report.get("generate_text")
    if report.get("generate_status") != 200 or not isinstance(text, str) or not text.strip():
        why = report.get("generate_error") or (f"status {report.get('generate_status')}, text {text!r}"
                                               + (f", body {report['generate_body']!r}"
                                                  if "generate_body" in report else ""))
        return failed(check, f"POST {url} {_on(probe)}: {why}")
    return passed(check, f"POST {url}: {GENERATE_REQUEST['text']!r} -> {text.strip()[:60]!r}")


def service_secrets(settings: Settings, probe: Probe) -> Outcome:
    """The unit names no secret variable and holds no secret value; the secrets file is 0600 root."""
    check = "service_secrets"
    skip = _systemd_or_skip(check, probe)
    if skip:
        return skip
    path = secrets_file(settings)
    section = probe["unit_secrets"]
    scan = parse_tabbed(section.text)
    problems = []
    if not section.ok:
        problems.append(f"cannot read the unit files of {settings.service_name}")
    if int((scan.get("names") or ["0"])[0] or 0):
        problems.append(f"the unit sets a secret variable ({', '.join(settings.service_secret_env)}) itself")
    if int((scan.get("values") or ["0"])[0] or 0):
        problems.append(f"the unit contains a value from {path}")
    stat = probe["secrets_file"].first_line()
    if stat == "absent":
        if settings.service_secret_env:
            problems.append(f"{path} is missing but service_secret_env names "
                            + ", ".join(settings.service_secret_env))
    elif stat.split()[:3] != ["600", "root", "root"]:
        problems.append(f"{path} is mode/owner/group {stat or '?'}, expected 600 root root")
    if problems:
        return failed(check, f"{settings.service_name} {_on(probe)}: " + "; ".join(problems))
    where = "absent (no secrets configured)" if stat == "absent" else "600 root root"
    return passed(check, f"no secret in the unit; {path} {where}")


# --- the catalogue ------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """A named check: the probe groups it reads, whether it needs servestack's own deploy
    (records, release, service) and the function judging it."""

    name: str
    groups: tuple[str, ...]
    judge: Callable[..., Outcome]
    deployed: bool = False


CHECKS = (
    Check("driver_version", ("host",), driver_version),
    Check("gpu_capability", ("host",), gpu_capability),
    Check("gpu_count", ("host",), gpu_count),
    Check("nvcc_version", ("host",), nvcc_version),
    Check("version_json", ("host",), version_json),
    Check("cuda_link", ("host",), cuda_link),
    Check("kept_toolkits", ("host",), kept_toolkits, deployed=True),
    Check("cuda_sample", ("sample",), cuda_sample),
    Check("package_version", ("python",), package_version, deployed=True),
    Check("torch_cuda_build", ("python",), torch_cuda_build),
    Check("torch_device_capability", ("python",), torch_device_capability),
    Check("torch_cuda_op", ("python",), torch_cuda_op),
    Check("sglang_sm120", ("python",), sglang_sm120, deployed=True),
    Check("patches_applied", ("host", "patches"), patches_applied, deployed=True),
    Check("service_active", ("host",), service_active, deployed=True),
    Check("service_user", ("host",), service_user, deployed=True),
    Check("service_environment", ("host",), service_environment, deployed=True),
    Check("service_secrets", ("host",), service_secrets, deployed=True),
    Check("service_health", ("host", "http"), service_health, deployed=True),
    Check("service_generate", ("host", "http"), service_generate, deployed=True),
)
CHECKS_BY_NAME = {check.name: check for check in CHECKS}


def judge_all(settings: Settings, probe: Probe, checks=CHECKS) -> list[Outcome]:
    """Every check's outcome; package_version once per manifest package."""
    outcomes = []
    for check in checks:
        if check.name == "package_version":
            outcomes += [package_version(settings, probe, package.name) for package in settings.packages]
        else:
            outcomes.append(check.judge(settings, probe))
    return outcomes


def groups_for(checks) -> tuple[str, ...]:
    wanted = {group for check in checks for group in check.groups}
    return tuple(group for group in GROUPS if group in wanted)
