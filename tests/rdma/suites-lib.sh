# Sourced (POSIX sh) by the scripts that run several suites in one boot of the Soft-RoCE VMs
# (single-node-tests.sh, two-node-tests.sh):
#   run NAME CMD [ARGS]...   runs one suite, prints how long it took, remembers a failure (the
#                            next suite runs either way)
#   finish WHAT              exits 0 when every suite passed, else 1, naming the ones that failed
_failed=""
_where="${RDMIG_NODE:+node $RDMIG_NODE: }"
run() {
  _name="$1"; shift
  echo; echo "##### $_where$_name"
  _start=$(date +%s)
  if "$@"; then
    echo "##### $_where$_name: passed in $(( $(date +%s) - _start )) s"
  else
    echo "##### $_where$_name: FAILED (exit $?) after $(( $(date +%s) - _start )) s"
    _failed="$_failed $_name"
  fi
}
finish() {
  if [ -n "$_failed" ]; then
    echo "$1${_where:+ (${_where%: })}: FAILED:$_failed"
    exit 1
  fi
  echo "$1${_where:+ (${_where%: })}: all passed"
  exit 0
}
