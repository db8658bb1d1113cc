"""The agents' data-plane proofs as a peer computes them, for tests that speak the wire themselves
(src/transport/wire.h control_proof, src/transport/channel_proof.h). Data-plane protocol 3 (bare
QEMU, path checks); the flow protocol's own version is in tests/kubevirt."""
import hashlib
import hmac
import os
import socket
import struct
import json

PROTOCOL = 3


def _hex(key, msg):
    return hmac.new(key.encode(), msg.encode(), hashlib.sha256).hexdigest()


def control_proof(token, target_nonce, migration_id, source_nonce):
    """The source's answer to the target's challenge on a control connection."""
    return _hex(token, "rdmig-control\n%s\n%s\n%s" % (target_nonce, migration_id, source_nonce))


def channel_key(token, source_nonce, target_nonce, session):
    """The key every data channel of a session proves: only the two ends that hold the token have it."""
    return _hex(token, "rdmig-channel-key\n%s\n%s\n%s" % (source_nonce, target_nonce, session))


def channel_proof(key, by, session, index, dialler_nonce, acceptor_nonce):
    """A TCP channel's proof: by is "dial" (the source's auth) or "accept" (the target's welcome)."""
    return _hex(key, "rdmig-channel\n%s\n%s\n%d\n%s\n%s" % (by, session, index, dialler_nonce, acceptor_nonce))


def nonce():
    return os.urandom(16).hex()


def send_frame(sock, msg):
    body = json.dumps(msg).encode()
    sock.sendall(struct.pack("<I", len(body)) + body)


def recv_frame(sock):
    """One length-prefixed JSON message, or None when the peer closed."""
    head = b""
    while len(head) < 4:
        part = sock.recv(4 - len(head))
        if not part:
            return None
        head += part
    n, data = struct.unpack("<I", head)[0], b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            return None
        data += part
    return json.loads(data)


def open_channel(port, hello, key, proof=None, host="127.0.0.1", timeout=10):
    """Opens a data channel as a source agent does: `hello` (a "nonce" is added), the target's
    challenge, the proof of `key` (or `proof` instead). Returns (socket, answer): the answer is the
    welcome (its proof checked: the target holds the key) or the reject, with "sent" (the proof
    sent) and "nonce" (the hello's) added."""
    s = socket.create_connection((host, port), timeout=timeout)
    hello = dict(hello)
    hello.setdefault("nonce", nonce())
    send_frame(s, hello)
    ch = recv_frame(s)
    if not ch or ch.get("type") != "challenge":
        return s, ch
    session, index = hello["session"], hello["index"]
    good = channel_proof(key, "dial", session, index, hello["nonce"], ch["nonce"])
    sent = good if proof is None else proof
    send_frame(s, {"type": "auth", "proof": sent})
    answer = recv_frame(s)
    if answer and answer.get("type") == "welcome":
        want = channel_proof(key, "accept", session, index, hello["nonce"], ch["nonce"])
        assert answer.get("proof") == want, "the target's welcome does not prove the key: %r" % answer
    return s, dict(answer or {}, sent=sent, nonce=hello["nonce"])


def accept_channel(sock, hello, key, acceptor_nonce=None):
    """Plays the target's side of one data channel's proof (for a stand-in target agent): the
    challenge, the check of the source's answer, the welcome with the target's proof. True when
    the source proved `key`."""
    acceptor_nonce = acceptor_nonce or nonce()
    send_frame(sock, {"type": "challenge", "nonce": acceptor_nonce})
    auth = recv_frame(sock)
    if not auth:
        return False
    want = channel_proof(key, "dial", hello["session"], hello["index"], hello["nonce"], acceptor_nonce)
    if not hmac.compare_digest(auth.get("proof", ""), want):
        send_frame(sock, {"type": "reject", "code": "permission_denied", "message": "auth.proof"})
        return False
    send_frame(sock, {"type": "welcome",
                      "proof": channel_proof(key, "accept", hello["session"], hello["index"], hello["nonce"],
                                             acceptor_nonce)})
    return True
