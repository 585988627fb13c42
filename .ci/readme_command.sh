#!/usr/bin/env bash
# Runs one of the README's first two commands, extracted from README.md so
# that CI runs exactly what a user reads. Usage: readme_command.sh example|test
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  example) marker="<!-- command:example -->" ;;
  test) marker="<!-- command:test -->" ;;
  *) echo "usage: $0 example|test" >&2; exit 2 ;;
esac
# The whole block after the marker (it may span several lines).
command=$(awk -v m="$marker" 'found && /^```/ {n++; if (n == 2) exit; next} found && n==1 {print} $0 == m {found=1}' README.md)
if [ -z "$command" ]; then
  echo "README.md has no command after $marker" >&2
  exit 1
fi
echo "+ $command"
bash -c "set -euo pipefail; $command"
