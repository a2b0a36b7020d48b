# Shared by the hack/*/build.sh scripts (sourced, never run). Needs the caller's `log`.

# go build -v names each package as it is compiled; show a count every $2 packages instead
# of thousands of lines (a cold build takes minutes on 2 cores), and pass errors through.
go_progress() {
  local what=$1 every=$2 n=0 line
  while IFS= read -r line; do
    case "$line" in
      *.go:[0-9]*|*": "*) printf '%s\n' "$line" >&2 ;;
      *) n=$((n + 1)); if [ $((n % every)) -eq 0 ]; then log "$what: $n packages compiled"; fi ;;
    esac
  done
  log "$what: $n packages compiled"
}
