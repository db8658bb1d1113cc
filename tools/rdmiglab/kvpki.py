"""A test CA and the two certificates of KubeVirt's migration mTLS (openssl CLI).

KubeVirt's migration server (target virt-handler) presents CN kubevirt.io:system:node:virt-handler
(serverAuth) and requires a client certificate with CN kubevirt.io:system:client:migration
(clientAuth); both sides check the chain and the CN, never the IP or a DNS name.
"""
import os
import subprocess

from .kvproxy import CLIENT_CN, SERVER_CN


def _openssl(*args, cwd):
    res = subprocess.run(("openssl",) + args, cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise RuntimeError("openssl %s: %s" % (" ".join(args), res.stderr.strip()))


def make_test_pki(out_dir, server_cn=SERVER_CN, client_cn=CLIENT_CN, days=2):
    """Writes ca.crt/ca.key, server.crt/.key and client.crt/.key (EC P-256) into out_dir;
    returns out_dir. The CNs can be changed to test that a wrong one is refused."""
    os.makedirs(out_dir, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", str(days),
             "-subj", "/CN=kubevirt.io@rdmig-test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=out_dir)
    for name, cn, eku in (("server", server_cn, "serverAuth"), ("client", client_cn, "clientAuth")):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + cn, cwd=out_dir)
        ext = os.path.join(out_dir, name + ".ext")
        with open(ext, "w") as f:
            f.write("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                    "extendedKeyUsage=%s\n" % eku)
        _openssl("x509", "-req", "-in", name + ".csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", name + ".crt", "-days", str(days), "-extfile", ext,
                 cwd=out_dir)
    for p in os.listdir(out_dir):
        if p.endswith(".key"):
            os.chmod(os.path.join(out_dir, p), 0o600)
    return out_dir
