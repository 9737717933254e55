#!/bin/bash
# The host tools as sent since servestack/hostcode.py (5d4429c), on the device: verify-python.py in the torch venv,
# ml_env.py with the system python under -I -S (backups, activate, record). Inputs: sent/ (script_text of each
# tool, made on the controller: the device has no pyinfra), OUT (where the outputs go).
set -u
cd "$(dirname "$0")"
enc() { python3 -c 'import base64,json,sys; print(base64.b64encode(sys.argv[1].encode()).decode())' "$1"; }
work=$(mktemp -d)
echo "== python: $(/usr/bin/python3 -V) / $(/opt/torch/.venv/bin/python -V); filesystem of $work: $(stat -f -c %T "$work")"
echo "== verify-python.py (sent), torch venv"
/opt/torch/.venv/bin/python -I -c "$(cat sent/verify-python.py)" '["torch"]'; echo "exit $?"
echo "== ml_env.py backups (sent), /usr/bin/python3 -I -S"
/usr/bin/python3 -I -S -c "$(cat sent/ml_env.py)" backups "$(enc "{\"state_dir\": \"$work/state\"}")"; echo "exit $?"
mkdir -p "$work/releases/r-aaaaaaaaaaaa/venv" && touch "$work/releases/r-aaaaaaaaaaaa/venv/pyvenv.cfg"
echo '{"status": "ok"}' > "$work/releases/r-aaaaaaaaaaaa/release.json"
echo "== ml_env.py activate (sent): point_link + write_atomically"
/usr/bin/python3 -I -S -c "$(cat sent/ml_env.py)" activate "$(enc "{\"venv_path\": \"$work/ml-env\", \"releases_dir\": \"$work/releases\", \"state_dir\": \"$work/state\", \"release\": \"r-aaaaaaaaaaaa\", \"by\": \"device-check\", \"adopt_as\": \"adopted-x\"}")"; echo "exit $?"
echo "== ml_env.py record (sent)"
/usr/bin/python3 -I -S -c "$(cat sent/ml_env.py)" record "$(enc "{\"state_dir\": \"$work/state\", \"release\": \"r-aaaaaaaaaaaa\", \"previous\": null, \"by\": \"device-check\"}")"; echo "exit $?"
echo "== what they left"
ls -la "$work" "$work/state"; readlink "$work/ml-env"; cat "$work/state/releases.json"
mkdir -p "$OUT" && cp -r "$work/state" "$OUT/state"
