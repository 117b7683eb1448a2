#!/usr/bin/env bash
# The system packages reroll uses beside Python, and what goes without each. `make demo` needs
# none of them; `make test` (and CI) wants them all.
#
#   tools/system-packages.sh install   as root with apt-get: install the missing ones (CI does
#                                      this; a failed install fails under CI=true); otherwise, or
#                                      when apt-get fails, say what will not work and go on
#   tools/system-packages.sh report    only say what is missing and what will not work
set -u
mode=${1:-report}
packages=()
notes=()
have() { command -v "$1" >/dev/null 2>&1; }
need() {  # need DEBIAN-PACKAGE WHAT-WILL-NOT-WORK
  packages+=("$1")
  notes+=("$2")
}

have bwrap || need bubblewrap "bubblewrap missing: code rewards (reward.type: code), the terminal \
and math_python envs and the sandbox will not run; their tests skip"
test -x /usr/bin/python3 || need python3 "/usr/bin/python3 missing: the sandbox runs untrusted \
programs with it, so code rewards and the terminal and math_python envs will not run"
have chromium || have chromium-browser || need chromium "chromium missing: the report's \
browser tests skip (reroll view itself needs no browser to write the report)"
have chromedriver || need chromium-driver "chromedriver missing: the report's browser tests skip"

[ ${#packages[@]} -eq 0 ] && exit 0
if [ "$mode" = install ] && [ "$(id -u)" = 0 ] && have apt-get; then
  if apt-get update -qq && apt-get install -y -qq "${packages[@]}"; then
    exit 0
  fi
  echo "reroll set-up: apt-get install ${packages[*]} failed" >&2
  [ -n "${CI:-}" ] && exit 1
fi
for note in "${notes[@]}"; do
  echo "reroll set-up: $note." >&2
done
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo "
echo "reroll set-up: everything else works; to have these too: ${sudo}apt-get install ${packages[*]}" >&2
exit 0
