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
command=$(awk -v m="$marker" 'found && /^```/ {n++; next} found && n==1 {print; exit} $0 == m {found=1}' README.md)
if [ -z "$command" ]; then
  echo "README.md has no command after $marker" >&2
  exit 1
fi
echo "+ $command"
bash -c "set -euo pipefail; $command"
