"""Test certificates for the agents' HTTPS API (openssl CLI), shaped like the chart's.

The chart (agent.tls.mode generate) makes a CA and one agent certificate whose only name is
the DNS name "rdmig-agent" (no IPs: the controller dials agents by pod IP but checks the name
it is configured with, agents.tls.serverName). make_agent_pki writes the same, plus a second,
unrelated CA so a test can point a client at the wrong one.
"""
import os
import subprocess

SERVER_NAME = "rdmig-agent"


def _openssl(*args, cwd):
    res = subprocess.run(("openssl",) + args, cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise RuntimeError("openssl %s: %s" % (" ".join(args), res.stderr.strip()))


def _ca(out_dir, name, cn, days):
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", name + ".key", "-out", name + ".crt", "-days", str(days), "-subj", "/CN=" + cn,
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=out_dir)


def _leaf(out_dir, name, ca, names, days):
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + names[0], cwd=out_dir)
    ext = os.path.join(out_dir, name + ".ext")
    with open(ext, "w") as f:
        f.write("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=serverAuth\nsubjectAltName=%s\n" % ",".join("DNS:" + n for n in names))
    _openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".crt", "-CAkey", ca + ".key",
             "-CAcreateserial", "-out", name + ".crt", "-days", str(days), "-extfile", ext, cwd=out_dir)


def make_agent_pki(out_dir, names=(SERVER_NAME,), days=2):
    """Writes into out_dir: ca.crt/ca.key (the agents' CA), agent.crt/agent.key (signed by it,
    DNS names `names`, first one also the CN), other-ca.crt/.key (a CA that signed nothing here)
    and other.crt/other.key (a certificate from other-ca, for a key that does not match
    agent.crt). Returns a dict of the paths."""
    os.makedirs(out_dir, exist_ok=True)
    _ca(out_dir, "ca", "rdmig-test-ca", days)
    _ca(out_dir, "other-ca", "rdmig-test-other-ca", days)
    _leaf(out_dir, "agent", "ca", list(names), days)
    _leaf(out_dir, "other", "other-ca", list(names), days)
    for p in os.listdir(out_dir):
        if p.endswith(".key"):
            os.chmod(os.path.join(out_dir, p), 0o600)
    return {k: os.path.join(out_dir, v) for k, v in
            (("ca", "ca.crt"), ("cert", "agent.crt"), ("key", "agent.key"), ("other_ca", "other-ca.crt"),
             ("other_cert", "other.crt"), ("other_key", "other.key"))}
