# Shell helpers of the serving benchmarks (sourced): `serve LOG ARGS...` starts
# `parashift run $SERVE ARGS...` in its own process group and waits for /health on $PORT (the
# server's pid in $pid); `stop` ends that group and waits until the server is gone.
serve() {
  local log=$1; shift
  setsid "$PY" -m parashift.cli run "${SERVE[@]}" "$@" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0
    kill -0 "$pid" 2> /dev/null || { cat "$log"; return 1; }
    sleep 1
  done
  return 1
}
stop() {
  kill -INT -- "-$pid" 2> /dev/null || kill -INT "$pid"
  while kill -0 "$pid" 2> /dev/null; do sleep 0.5; done
}
