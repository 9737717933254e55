"""Stand-in for NVIDIA's CUDA runfile installer: a small makeself archive with the real file name.

`build_runfile(dest_dir, mode)` builds `cuda_<version>_<driver>_linux.run` (name from the
manifest) that installs a stand-in toolkit tree (see toolkit.py) of the manifest's CUDA version.
Like the real installer it is run as `sh FILE --silent --toolkit --installpath=PATH ...`:
NVIDIA's flags are accepted without a `--` separator, because the archive is built with a copy
of makeself's header whose unknown-flag branch hands the flags to the install script instead of
failing; the same header honours `--tmpdir=PATH` for its own extraction and treats `--silent`
as quiet (no integrity or progress messages). The install script:

- accepts `--silent --toolkit --installpath=P | --toolkitpath=P --no-opengl-libs --no-drm
  --no-man-page --override --tmpdir=P --extract=P` and rejects anything else;
- refuses without `--silent` (the real one would show the EULA), and refuses `--driver` or a
  silent run without `--toolkit` (both would install the driver);
- appends `[INFO]: ...` lines to /tmp/cuda-installer.log whatever `--tmpdir` and TMPDIR say (the
  real installer has that path built in: nixpkgs' cudatoolkit recipe patches the string out of
  its binary), and as root the same lines to /var/log/cuda-installer.log (where the real one
  run as root says "See log at ..."; which of the two it keeps is not documented);
- crashes (SIGSEGV, exit 139, nothing installed) when a stale /tmp/cuda-installer.log cannot be
  replaced, as the real one does (public install notes and EasyBuild's CUDA easyblock, which
  removes the file before and after an install for that reason): the file is not writable, or it
  belongs to another user than the installer's and /tmp's in the sticky, world-writable /tmp.
  The last case is the kernel's fs.protected_regular rule (1 by default under systemd >= 241),
  which refuses that open(O_CREAT) even to root; the sandbox's kernel may have it off, so the
  stand-in applies the rule itself;
- checks the compiler as the real one does, with its log wording: when the host's sandbox knob
  /etc/servestack-sandbox/gcc-version holds a version (what this host's gcc "reports"; no such
  file: a supported gcc), it logs `[INFO]: Checking compiler version...`, `[INFO]: gcc location:
  /usr/bin/gcc`, `[INFO]: gcc version: gcc version V ...` and `[ERROR]: unsupported compiler
  version: V. Use --override to override this check.`, prints ` Failed to verify gcc version.
  See log at LOG for details.` and exits 1 having installed nothing, unless `--override` is
  passed (which skips that check). The real installer's exit code is not documented (an older
  one was reported to exit 0: chainer/chainer-test#525); servestack decides from nvcc and the log;
- waits before it copies the tree for as long as the host's sandbox knob file
  /etc/servestack-sandbox/install-hold exists, having logged `[INFO]: STAND-IN: holding ...` (the
  real one takes minutes; a test interrupts a run meanwhile, then removes the file to let it end);
- behaves per build-time `mode`: "normal"; "repoint" (also points /usr/local/cuda at the install
  path, as the real installer may); "fail_midway" (copies part of the tree, logs an error,
  exits 1); "broken_nvcc" (exits 0 but the installed nvcc cannot run).

Every absolute path it writes is prefixed with $SERVESTACK_STANDIN_ROOT when set (unit tests),
like DESTDIR. The archive cannot match the manifest's size and checksums: `runfile_info()`
gives the stand-in's own, for the sandbox to put in place of the manifest's.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sandbox.standins.stack import manifest
from sandbox.standins.toolkit import write_toolkit_tree

MODES = ("normal", "repoint", "fail_midway", "broken_nvcc")
MAKESELF_HEADER = Path("/usr/share/makeself/makeself-header.sh")

#: What `bin/nvcc` becomes in "broken_nvcc" mode: a truncated ELF file ("Exec format error").
BROKEN_NVCC = b"\x7fELF\x02\x01\x01" + b"\x00" * 57

_STOCK_UNKNOWN_FLAG = '''    -*)
	echo Unrecognized flag : "\\$1" >&2
	MS_Help
	exit 1
	;;
'''
_PASS_UNKNOWN_FLAG = '''    -*)
	break ;;
'''
_OPTION_LOOP = 'initargs="\\$@"\n'
_PRESCAN = '''for ms_arg in "\\$@"; do
    case "\\$ms_arg" in
    --tmpdir=*) TMPROOT="\\${ms_arg#--tmpdir=}" ;;
    --silent) quiet="y"; noprogress="y" ;;
    esac
done
'''


@dataclass(frozen=True)
class RunfileInfo:
    """Name, size and checksums of a built stand-in runfile (what the manifest holds for the real one)."""

    file: str
    size: int
    md5: str
    sha256: str


def runfile_info(path: Path) -> RunfileInfo:
    """Size, md5 and sha256 of the file at `path`."""
    md5, sha256 = hashlib.md5(), hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            md5.update(block)
            sha256.update(block)
    return RunfileInfo(Path(path).name, Path(path).stat().st_size, md5.hexdigest(), sha256.hexdigest())


def write_md5sum(path: Path, files: list[Path]) -> Path:
    """Write NVIDIA's md5sum.txt format (`<md5>  <file name>` per line) for `files` at `path`."""
    lines = [f"{runfile_info(file).md5}  {Path(file).name}\n" for file in files]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return path


def patched_header(stock: str) -> str:
    """makeself's header with NVIDIA-style flag handling (see the module docstring)."""
    if _STOCK_UNKNOWN_FLAG not in stock or _OPTION_LOOP not in stock:
        raise RuntimeError(f"{MAKESELF_HEADER}: not the makeself 2.4 header this stand-in patches")
    patched = stock.replace(_STOCK_UNKNOWN_FLAG, _PASS_UNKNOWN_FLAG)
    return patched.replace(_OPTION_LOOP, _PRESCAN + _OPTION_LOOP, 1)


def _install_script(mode: str, version: str, install_path: str) -> str:
    major_minor = ".".join(version.split(".")[:2])
    return _INSTALL_SH.replace("@MODE@", mode).replace("@VERSION@", version) \
        .replace("@MAJOR_MINOR@", major_minor).replace("@DEFAULT_PATH@", install_path)


def _write_payload(payload: Path, mode: str) -> None:
    cuda = manifest().cuda
    toolkit = write_toolkit_tree(payload / "toolkit", cuda["version"], cuda["nvcc_version"])
    if mode == "broken_nvcc":
        (toolkit / "bin" / "nvcc").write_bytes(BROKEN_NVCC)
    script = payload / "install.sh"
    script.write_text(_install_script(mode, cuda["version"], cuda["install_path"]))
    script.chmod(0o755)


def build_runfile(dest_dir: Path, mode: str = "normal") -> Path:
    """Build the stand-in runfile in `dest_dir` under the manifest's x86_64 file name; return its path."""
    if mode not in MODES:
        raise ValueError(f"runfile mode {mode!r}: expected one of {MODES}")
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / manifest().runfiles["x86_64"].file
    with tempfile.TemporaryDirectory(prefix="standin-runfile-") as work_dir:
        work = Path(work_dir)
        header = work / "header.sh"
        header.write_text(patched_header(MAKESELF_HEADER.read_text()))
        payload = work / "payload"
        _write_payload(payload, mode)
        label = f"CUDA {manifest().cuda['version']} STAND-IN installer (servestack sandbox, mode {mode})"
        subprocess.run(["makeself", "--quiet", "--nox11", "--keep-umask", "--header", str(header),
                        str(payload), str(out), label, "./install.sh"], check=True)
    return out


_INSTALL_SH = r'''#!/bin/sh
# STAND-IN for NVIDIA's CUDA @VERSION@ runfile installer (servestack sandbox): no driver, no real
# toolkit. It installs the stand-in tree next to this script. Build mode: @MODE@.
MODE=@MODE@
ROOT="${SERVESTACK_STANDIN_ROOT:-}"
installpath=@DEFAULT_PATH@
silent=n toolkit=n override=n extract=

TMPLOG="$ROOT/tmp/cuda-installer.log"
if [ "$(id -u)" = 0 ]; then LOG="$ROOT/var/log/cuda-installer.log"; else LOG="$TMPLOG"; fi
GCC_KNOB="$ROOT/etc/servestack-sandbox/gcc-version"
HOLD_KNOB="$ROOT/etc/servestack-sandbox/install-hold"

# The real installer opens /tmp/cuda-installer.log first and crashes when it cannot (see the
# module docstring): SIGSEGV, no core file.
crash() { ulimit -c 0; kill -SEGV $$; exit 139; }
replaceable() {   # FILE: can this process open FILE with O_CREAT, fs.protected_regular applied?
    [ -e "$1" ] || return 0
    [ -w "$1" ] || return 1
    dir=$(dirname "$1"); owner=$(stat -c %u "$1")
    if [ "$owner" = "$(id -u)" ] || [ "$owner" = "$(stat -c %u "$dir")" ]; then return 0; fi
    if [ -k "$dir" ] && [ "$(stat -c %A "$dir" | cut -c9)" = w ]; then return 1; fi
    return 0
}
mkdir -p "$(dirname "$TMPLOG")" "$(dirname "$LOG")"
replaceable "$TMPLOG" || crash
: >> "$TMPLOG" 2>/dev/null || crash
log() {
    echo "[$1]: $2" >> "$TMPLOG"
    if [ "$LOG" != "$TMPLOG" ]; then echo "[$1]: $2" >> "$LOG"; fi
}
refuse() { echo "$1"; log ERROR "$1"; exit 1; }

for arg in "$@"; do
    case "$arg" in
    --silent) silent=y ;;
    --toolkit) toolkit=y ;;
    --installpath=*|--toolkitpath=*) installpath="${arg#*=}" ;;
    --override) override=y ;;
    --no-opengl-libs|--no-drm|--no-man-page|--tmpdir=*) ;;
    --extract=*) extract="${arg#*=}" ;;
    --driver) refuse "STAND-IN installer: --driver is refused here (the sandbox never installs a driver)" ;;
    *) refuse "Unknown option: $arg" ;;
    esac
done

log INFO "STAND-IN CUDA @VERSION@ installer (servestack sandbox), mode $MODE, arguments: $*"
if [ -n "$extract" ]; then
    mkdir -p "$ROOT$extract" && cp -a toolkit/. "$ROOT$extract/" && log INFO "Extracted to $extract" && exit 0
    exit 1
fi
[ "$silent" = y ] || refuse "STAND-IN installer: the interactive installer (EULA) is not available; pass --silent"
[ "$toolkit" = y ] || refuse "STAND-IN installer: a silent run without --toolkit would install the driver; refused"
case "$installpath" in /*) ;; *) refuse "Install path must be absolute: $installpath" ;; esac

log INFO "Driver not installed."
log INFO "Checking compiler version..."
if [ -f "$GCC_KNOB" ] && [ "$override" != y ]; then
    gcc_version=$(head -n 1 "$GCC_KNOB")
    log INFO "gcc location: /usr/bin/gcc"
    log INFO "gcc version: gcc version $gcc_version (servestack sandbox stand-in)"
    log ERROR "unsupported compiler version: $gcc_version. Use --override to override this check."
    echo " Failed to verify gcc version. See log at ${LOG#$ROOT} for details."
    exit 1
fi
log INFO "Initializing menu"
log INFO "Setup complete"
log INFO "Components to install: "
log INFO "CUDA Toolkit @MAJOR_MINOR@"
log INFO "Installing: CUDA Toolkit"
dest="$ROOT$installpath"
mkdir -p "$dest"
if [ -e "$HOLD_KNOB" ]; then
    log INFO "STAND-IN: holding before the copy while ${HOLD_KNOB#$ROOT} exists"
    while [ -e "$HOLD_KNOB" ]; do sleep 0.2; done
fi
if [ "$MODE" = fail_midway ]; then
    cp -a toolkit/targets toolkit/version.json "$dest/"
    log ERROR "Install of CUDA Toolkit @MAJOR_MINOR@ failed, quitting"
    echo "Installation failed. See log at ${LOG#$ROOT} for details."
    exit 1
fi
cp -a toolkit/. "$dest/" || refuse "Installation failed. See log at ${LOG#$ROOT} for details."
log INFO "Installed: CUDA Toolkit @MAJOR_MINOR@ in $installpath"
if [ "$MODE" = repoint ]; then
    link="$ROOT/usr/local/cuda"
    if [ -L "$link" ] || [ ! -e "$link" ]; then
        mkdir -p "$(dirname "$link")"
        ln -sfn "$installpath" "$link"
        log INFO "Created symlink /usr/local/cuda -> $installpath"
    fi
fi
log INFO "Uninstall manifest created"
log INFO "Summary: Toolkit installed in $installpath"
exit 0
'''
