import json, os, subprocess, sys, tempfile, time, shutil
REPO = "/work/main"
sys.path.insert(0, os.path.join(REPO, "tools")); sys.path.insert(0, os.path.join(REPO, "bench"))
import kubevirt as kb
from rdmiglab.kvagents import KubevirtAgents
from rdmiglab.kubevirt import KubevirtCluster
runs = int(sys.argv[1]); outdir = sys.argv[2]; tls = sys.argv[3] == "on"; par = int(sys.argv[4])
mig = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
os.makedirs(outdir, exist_ok=True)
work = tempfile.mkdtemp(prefix="probe-")
res = []
with KubevirtCluster() as cluster, KubevirtAgents(work, cluster.nodes, transport="tcp", migration=mig) as kv:
    cluster.define_and_start_vmi("benchvm", "default", mem_mib=256, dirty_mib=16, boot_counter=2)
    samplers = []
    for label, ns in (("host", None), ("a", cluster.netns("node-a")), ("b", cluster.netns("node-b"))):
        argv = [sys.executable, "/tmp/probe/sampler.py", os.path.join(outdir, "q-%s.jsonl" % label), str(runs * 2 * 40 + 60)]
        if ns: argv = ["ip", "netns", "exec", ns] + argv
        samplers.append(subprocess.Popen(argv))
    for i in range(runs):
        for path in (kb.PATHS if i % 2 == 0 else kb.PATHS[::-1]):
            kb.revive(cluster)
            src = cluster.vmi.node
            t0 = time.monotonic()
            r = kb.run_once(cluster, kv, path, tls, par)
            t1 = time.monotonic()
            r.update(t0=t0, t1=t1, src=src)
            res.append(r)
            print(i, path, src, r.get("valid"), r.get("downtime_ms"), r.get("total_time_ms"), r.get("invalid", ""), flush=True)
    for s in samplers: s.kill()
json.dump(res, open(os.path.join(outdir, "runs.json"), "w"), indent=1, default=str)
shutil.rmtree(work, ignore_errors=True)
