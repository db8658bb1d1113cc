"""An rdmig-agent REST stand-in for controller fault tests (Python stdlib only).

Speaks the part of the agent API the controller uses (POST/GET/DELETE /v1/migrations and
/v1/pathchecks, bearer token) and can misbehave on purpose: answer a path check's GET with any
view (`pathcheck_view`, e.g. one listing 1000 rails), answer POST late (`post_delay`, seconds), keep a created
migration in one phase forever (`phase`) until the test ends it (`end()`, with the agent's own
words). Reports `transport`/`transportReason` as the agents do once the data plane is up, and any
other fields of the agent's status given as `status_extra` (e.g. `rails`, `railsLeftOut`).
Records every request and what it still holds, so a test can ask "is anything left running
here?". Binds 127.0.0.1:0 and reports its port.
"""
import http.server
import json
import threading
import time

TERMINAL = ("Succeeded", "Failed", "Cancelled")


class AgentStandin:
    def __init__(self, token, name="standin", post_delay=0.0, phase="Migrating", transport=None,
                 transport_reason=None, pathcheck_view=None, status_extra=None):
        self.token, self.name = token, name
        self.status_extra = dict(status_extra or {})
        self.pathcheck_view = pathcheck_view
        self.pathchecks = {}   # id -> phase
        self.post_delay, self.phase = post_delay, phase
        self.transport, self.transport_reason = transport, transport_reason
        self.lock = threading.Lock()
        self.migrations = {}   # id -> agent-shaped status
        self.requests = []     # (method, path)
        self.previous_token = None  # also accepted, as a real agent does within tokenGraceSeconds
        self.tokens_seen = []  # the bearer token of each request
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up waiting: the work is done all the same

            def _error(self, code, message):
                self._send(code, {"error": {"code": code, "message": message}})

            def _handle(self):
                with outer.lock:
                    outer.requests.append((self.command, self.path))
                auth = self.headers.get("Authorization") or ""
                with outer.lock:
                    outer.tokens_seen.append(auth[len("Bearer "):])
                if auth not in ["Bearer " + t for t in (outer.token, outer.previous_token) if t]:
                    return self._error(401, "unauthorized")
                parts = [p for p in self.path.split("?")[0].split("/") if p]
                if parts[:2] == ["v1", "pathchecks"]:
                    return self._pathcheck(parts)
                if parts[:2] != ["v1", "migrations"]:
                    return self._error(404, "no route")
                if self.command == "POST" and len(parts) == 2:
                    n = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(n) or b"{}")
                    time.sleep(outer.post_delay)
                    mid = body.get("id", "m-x")
                    with outer.lock:
                        outer.migrations[mid] = {"id": mid, "role": body.get("role"), "vm": body.get("vm"),
                                                 "phase": outer.phase, "transport": outer.transport,
                                                 "transportReason": outer.transport_reason,
                                                 "progress": {}, "result": {}, **outer.status_extra}
                    return self._send(201, {"migrationId": mid, "endpoint": "127.0.0.1:1", "token": "t",
                                            "phase": outer.phase})
                if len(parts) != 3:
                    return self._error(405, "method not allowed")
                mid = parts[2]
                with outer.lock:
                    m = outer.migrations.get(mid)
                    if m is None:
                        return self._error(404, "no migration " + mid)
                    if self.command == "DELETE" and m["phase"] not in TERMINAL:
                        m["phase"] = "Cancelled"
                        m["result"] = {"reason": "cancelled by request"}
                    body = dict(m)
                if self.command in ("GET", "DELETE"):
                    return self._send(200 if self.command == "GET" else 202, body)
                return self._error(405, "method not allowed")

            def _pathcheck(self, parts):
                if self.command == "POST" and len(parts) == 2:
                    n = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(n) or b"{}")
                    cid = body.get("id") or "pc-standin"
                    with outer.lock:
                        outer.pathchecks[cid] = "Pending"
                    return self._send(201, {"id": cid, "role": body.get("role"), "endpoint": "127.0.0.1:1",
                                            "checkId": cid, "token": "t", "phase": "Pending"})
                if len(parts) != 3:
                    return self._error(405, "method not allowed")
                cid = parts[2]
                with outer.lock:
                    if cid not in outer.pathchecks:
                        return self._error(404, "no path check " + cid)
                    if self.command == "DELETE":
                        outer.pathchecks[cid] = "Cancelled"
                        return self._send(200, {"id": cid, "phase": "Cancelled"})
                view = dict(outer.pathcheck_view or {"phase": "Migrating"}, id=cid)
                return self._send(200, view)

            do_GET = do_POST = do_DELETE = _handle

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def end(self, mid, phase, reason=None, **result):
        """Ends migration `mid` as the agent would: `phase` with result.reason (the agent's text)
        and any other result fields (targetState, downtimeMs, ...)."""
        with self.lock:
            m = self.migrations[mid]
            m["phase"] = phase
            m["result"] = dict(result, reason=reason)

    def running(self):
        """Ids of migrations this stand-in holds that have not ended."""
        with self.lock:
            return [mid for mid, m in self.migrations.items() if m["phase"] not in TERMINAL]

    def count(self, method, prefix="/v1/migrations"):
        with self.lock:
            return sum(1 for m, p in self.requests if m == method and p.startswith(prefix))

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
