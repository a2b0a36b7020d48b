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

# The Kubernetes version to build: $1 if given, else $DRA_K8S_VERSION, else the default
# (the version hack/cluster/go.mod pins). Prints it; refuses what is not vMAJOR.MINOR.PATCH.
k8s_version_arg() {
  local v=${1:-${DRA_K8S_VERSION:-$DEFAULT_K8S_VERSION}}
  case "$v" in v*) ;; *) v="v$v" ;; esac
  if ! [[ "$v" =~ ^v1\.[0-9]+\.[0-9]+$ ]]; then
    echo "Kubernetes version '$v': write it as v1.MINOR.PATCH, e.g. v1.34.4" >&2
    return 1
  fi
  echo "$v"
}

# Writes into $2 a Go module that builds k8s.io/kubernetes $1 (with the staging modules its
# go.mod names at v0.0.0 replaced by v0.MINOR.PATCH) and the commands named by the blank
# imports in $3 (a tools.go). For versions other than the one hack/cluster/go.mod pins; the
# go.sum is made here (go mod tidy), so the build needs the Go module proxy once.
k8s_generate_module() {
  local version=$1 dir=$2 tools=$3 staging gomod m
  staging="v0.${version#v1.}"
  mkdir -p "$dir/tools"
  cp "$tools" "$dir/tools/tools.go"
  gomod=$(GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  [ -f "$gomod" ] || { echo "cannot download k8s.io/kubernetes@$version from the Go module proxy" >&2; return 1; }
  (
    cd "$dir"
    rm -f go.mod go.sum
    go mod init "github.com/gpu-dra-driver/hack/k8s-$version" >/dev/null 2>&1
    go mod edit -go=1.26.8
    for m in $(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$gomod" | sort -u); do
      go mod edit -replace "$m=$m@$staging"
    done
    go mod edit -require "k8s.io/kubernetes@$version"
    GOFLAGS=-mod=mod go mod tidy
  )
}
