"""KubeVirt's node hook (kubevirt.hooks.plugins.v1alpha1.NodeHookService) without stubs.

The messages are tiny, so they are encoded by hand (protobuf wire format, proto3):
    message NodeContext            { string node_name = 1; }
    message ExecuteNodeHookRequest { string hookPoint = 1; bytes vmi = 2; NodeContext node_context = 3; }
    message ExecuteNodeHookResponse {}
Only ``call_node_hook`` and ``serve_node_hook`` need python3-grpcio; the codec is stdlib.
"""
import time

METHOD = "/kubevirt.hooks.plugins.v1alpha1.NodeHookService/ExecuteNodeHook"
PRE_MIGRATION_SOURCE = "PreMigrationSource"
# KubeVirt's DialSocketWithTimeout: a blocking dial bounded by CONNECT_TIMEOUT_SECONDS.
CONNECT_TIMEOUT_S = 2.0
DEFAULT_TIMEOUT_S = 30.0  # hooksclient.DefaultTimeout


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(number, payload):
    return _varint((number << 3) | 2) + _varint(len(payload)) + payload


def encode_request(hook_point, vmi_json, node_name):
    """ExecuteNodeHookRequest bytes; ``vmi_json`` is bytes or str (the VMI as JSON)."""
    if isinstance(vmi_json, str):
        vmi_json = vmi_json.encode()
    out = b""
    if hook_point:
        out += _len_field(1, hook_point.encode())
    if vmi_json:
        out += _len_field(2, vmi_json)
    out += _len_field(3, _len_field(1, node_name.encode()) if node_name else b"")
    return out


def _fields(data):
    """Yields (number, wire_type, value) of a protobuf message (varint and length fields)."""
    i = 0
    while i < len(data):
        key, i = _read_varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(data, i)
        elif wire == 2:
            n, i = _read_varint(data, i)
            if i + n > len(data):
                raise ValueError("field %d: length %d past the end" % (number, n))
            value, i = data[i:i + n], i + n
        else:
            raise ValueError("field %d: unsupported wire type %d" % (number, wire))
        yield number, wire, value


def _read_varint(data, i):
    shift = value = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def decode_request(data):
    """Returns {"hookPoint": str, "vmi": bytes, "nodeName": str} (unknown fields skipped)."""
    out = {"hookPoint": "", "vmi": b"", "nodeName": ""}
    for number, wire, value in _fields(data):
        if number == 1 and wire == 2:
            out["hookPoint"] = value.decode()
        elif number == 2 and wire == 2:
            out["vmi"] = value
        elif number == 3 and wire == 2:
            for n2, w2, v2 in _fields(value):
                if n2 == 1 and w2 == 2:
                    out["nodeName"] = v2.decode()
    return out


def call_node_hook(socket_path, hook_point, vmi_json, node_name, timeout=DEFAULT_TIMEOUT_S,
                   connect_timeout=CONNECT_TIMEOUT_S):
    """Calls ExecuteNodeHook over gRPC on a unix socket the way virt-handler does: a
    blocking dial bounded by ``connect_timeout``, then the call bounded by ``timeout``.
    Returns a dict {ok, error, code, duration_s, call_s}; never raises for a hook failure.
    duration_s is the whole (dial included: this client's own gRPC start-up is in it);
    call_s the call alone, from request to answer: the agent's decision time."""
    import grpc  # python3-grpcio
    t0 = time.monotonic()
    result = {"ok": False, "error": None, "code": None, "duration_s": None, "call_s": None}
    channel = grpc.insecure_channel("unix:" + socket_path,
                                    options=[("grpc.default_authority", "localhost")])
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            result["error"] = "failed to dial %s: not ready within %.0fs" % (
                socket_path, connect_timeout)
            return result
        call = channel.unary_unary(METHOD, request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        t_call = time.monotonic()
        try:
            call(encode_request(hook_point, vmi_json, node_name), timeout=timeout)
            result["ok"] = True
        except grpc.RpcError as e:
            result["code"] = e.code().name if e.code() else None
            result["error"] = "node hook %s failed with %s: %s" % (
                hook_point, result["code"], e.details())
        result["call_s"] = round(time.monotonic() - t_call, 3)
        return result
    finally:
        channel.close()
        result["duration_s"] = round(time.monotonic() - t0, 3)


def serve_node_hook(socket_path, handler, max_workers=4):
    """Starts a NodeHookService server on a unix socket for tests. ``handler(request_dict,
    context)`` runs per call (return None for success, or call context.abort). Returns the
    grpc.Server (stop it with server.stop(0))."""
    import grpc
    from concurrent import futures

    def execute(request_bytes, context):
        handler(decode_request(request_bytes), context)
        return b""  # ExecuteNodeHookResponse {}

    method = grpc.unary_unary_rpc_method_handler(
        execute, request_deserializer=lambda b: b, response_serializer=lambda b: b)
    service = grpc.method_handlers_generic_handler(
        "kubevirt.hooks.plugins.v1alpha1.NodeHookService", {"ExecuteNodeHook": method})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    server.add_generic_rpc_handlers((service,))
    server.add_insecure_port("unix:" + socket_path)
    server.start()
    return server


def vmi_json(uid, mig_uid, target_addr, port, source="node-a", target="node-b", post_copy=False):
    """A VMI (prod/web-1) as virt-handler hands it to the hook before a migration: KubeVirt's
    status.migrationState with the target proxy's address and the memory port (49152)."""
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "web-1", "namespace": "prod", "uid": uid},
        "status": {"nodeName": source, "migrationState": {
            "migrationUid": mig_uid, "sourceNode": source, "targetNode": target,
            "targetNodeAddress": target_addr, "mode": "PreCopy",
            "targetDirectMigrationNodePorts": {str(port): 49152, "1": 0},
            "migrationConfiguration": {"allowPostCopy": post_copy}}},
    }
