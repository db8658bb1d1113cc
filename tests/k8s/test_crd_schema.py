"""The RdmaMigration CRD: its openAPIV3Schema accepts the samples and refuses bad objects.

Run: python3 tests/k8s/test_crd_schema.py -v (ctest label k8s).
"""
import copy
import glob
import os
import sys
import unittest

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import schema_validator  # noqa: E402

CRD = os.path.join(REPO, "operator-manifests", "crd-rdmamigrations.yaml")
SAMPLES = sorted(glob.glob(os.path.join(REPO, "operator-manifests", "samples", "rdmamigration*.yaml")))


class CrdSchemaTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(CRD) as f:
            cls.crd = yaml.safe_load(f)
        cls.schema = schema_validator.load_crd_schema(CRD)
        with open(os.path.join(REPO, "operator-manifests", "samples", "rdmamigration-basic.yaml")) as f:
            cls.good = yaml.safe_load(f)  # the bare-QEMU kind
        with open(os.path.join(REPO, "operator-manifests", "samples", "rdmamigration-vmi.yaml")) as f:
            cls.vmi = yaml.safe_load(f)
        cls.vmi["spec"]["target"] = {"nodeSelector": {"feature.node.kubernetes.io/rdma.capable": "true"}}

    def errors(self, obj):
        return schema_validator.validate(obj, self.schema)

    def mutated(self, fn):
        obj = copy.deepcopy(self.good)
        fn(obj)
        return obj

    def test_crd_names_scope_and_version(self):
        spec = self.crd["spec"]
        self.assertEqual(self.crd["metadata"]["name"], "rdmamigrations.rdmig.io")
        self.assertEqual(spec["group"], "rdmig.io")
        self.assertEqual(spec["scope"], "Namespaced")
        self.assertEqual(spec["names"]["plural"], "rdmamigrations")
        self.assertEqual(spec["names"]["kind"], "RdmaMigration")
        self.assertIn("rdmig", spec["names"]["shortNames"])
        (version,) = spec["versions"]
        self.assertEqual(version["name"], "v1alpha1")
        self.assertTrue(version["served"] and version["storage"])
        self.assertEqual(version["subresources"], {"status": {}})
        cols = version["additionalPrinterColumns"]
        self.assertEqual([c["name"] for c in cols if not c.get("priority")],
                         ["Phase", "Source", "Target", "Reason", "Transport", "Progress", "Downtime", "Age"])
        self.assertEqual([c["name"] for c in cols if c.get("priority") == 1],
                         ["Switchover", "Throughput", "Bytes", "Transport Reason"])
        status = self.schema["properties"]["status"]
        for c in cols:
            # Every column reads status (or metadata), so it is right for both kinds.
            self.assertRegex(c["jsonPath"], r"^\.(status|metadata)\.", c["name"])
            node = {"properties": {"status": status, "metadata": {"properties": {"creationTimestamp": {}}}}}
            for part in c["jsonPath"].strip(".").split("."):
                self.assertIn(part, node.get("properties", {}), "%s: %s is not in the schema" % (c["name"], c["jsonPath"]))
                node = node["properties"][part]

    def test_status_phase_enum_matches_the_controller(self):
        status = self.schema["properties"]["status"]["properties"]
        self.assertEqual(status["phase"]["enum"],
                         ["Pending", "PreparingTarget", "Migrating", "Succeeded", "Failed", "Cancelled"])
        cond = status["conditions"]["items"]
        self.assertEqual(set(cond["required"]), {"type", "status", "lastTransitionTime", "reason", "message"})

    def test_schema_uses_only_keywords_the_validator_checks(self):
        # validate() reports unknown keywords; walk every sub-schema through an empty object.
        def walk(s, path):
            self.assertEqual([k for k in s if k not in schema_validator.KNOWN], [], path)
            for k, sub in (s.get("properties") or {}).items():
                walk(sub, path + "." + k)
            if "items" in s:
                walk(s["items"], path + "[]")
        walk(self.schema, "<root>")

    def test_vmi_sample_is_the_minimal_object(self):
        with open(os.path.join(REPO, "operator-manifests", "samples", "rdmamigration-vmi.yaml")) as f:
            self.assertEqual(yaml.safe_load(f)["spec"], {"source": {"vmi": {"name": "web-1"}}})

    def test_samples_validate(self):
        self.assertGreaterEqual(len(SAMPLES), 3)
        for path in SAMPLES:
            with open(path) as f:
                obj = yaml.safe_load(f)
            self.assertEqual(self.errors(obj), [], path)

    def test_vmi_status_written_by_controller_validates(self):
        obj = copy.deepcopy(self.vmi)
        obj["status"] = {
            "phase": "Succeeded", "reason": "NotCarriedByRdmig", "sourceNode": "node-a", "targetNode": "node-b",
            "transport": "rdma", "transportReason": "auto-both-rdma", "channels": 9, "downtimeMs": 17,
            "display": {"progress": "100%", "downtime": "17ms", "switchover": "40ms", "throughput": "2.1GB/s",
                        "bytes": "537MB"},
            "kubevirt": {"migrationName": "rdmig-move-web-1", "migrationUid": "u", "vmiUid": "v",
                         "migrationPhase": "Succeeded", "targetPod": "virt-launcher-web-1-abcde", "mode": "PreCopy",
                         "phaseTransitionTimestamps": [{"phase": "Pending",
                                                        "phaseTransitionTimestamp": "2024-05-01T12:00:00Z"}],
                         "startTimestamp": "2024-05-01T12:00:01Z", "endTimestamp": "2024-05-01T12:00:03Z",
                         "completed": True, "failed": False},
            "conditions": [{"type": "CarriedByRdmig", "status": "False", "reason": "NotCarried", "message": "post-copy",
                            "observedGeneration": 1, "lastTransitionTime": "2024-05-01T12:00:03Z"}]}
        self.assertEqual(self.errors(obj), [])

    def test_status_written_by_controller_validates(self):
        obj = self.mutated(lambda o: o.update(status={
            "phase": "Succeeded", "observedGeneration": 1, "migrationId": "m-1",
            "sourceAgent": {"node": "a", "pod": "p", "address": "10.0.0.1:7470"},
            "targetAgent": {"node": "b", "pod": "q", "address": "10.0.0.2:7470"},
            "transport": "tcp", "channels": 1, "chunkSize": "4Mi",
            "progress": {"transferredBytes": 5, "remainingBytes": 0, "totalBytes": 5, "percent": 100,
                         "throughputBytesPerSecond": 1, "dirtyRateBytesPerSecond": 0, "passes": 2,
                         "chunksSent": 3, "chunksReceived": 3},
            "downtimeMs": 17, "switchoverMs": 40, "totalTimeMs": 2400, "targetState": "running",
            "startTime": "2024-05-01T12:00:00Z", "completionTime": "2024-05-01T12:00:03Z",
            "conditions": [{"type": "Succeeded", "status": "True", "reason": "Succeeded", "message": "ok",
                            "observedGeneration": 1, "lastTransitionTime": "2024-05-01T12:00:03Z"}]}))
        self.assertEqual(self.errors(obj), [])

    def test_rejects_chunk_size_without_binary_unit(self):
        for bad in ("4M", "4", "4MB", "0Mi", "-4Mi", "4 Mi", "4mi"):
            errs = self.errors(self.mutated(lambda o: o["spec"].update(chunkSize=bad)))
            self.assertTrue(any("chunkSize" in e for e in errs), (bad, errs))

    def test_rejects_unknown_transport(self):
        errs = self.errors(self.mutated(lambda o: o["spec"].update(transport="infiniband")))
        self.assertTrue(any("spec.transport" in e and "not one of" in e for e in errs), errs)

    def test_rejects_qemu_source_without_target_or_on_the_same_node(self):
        errs = self.errors(self.mutated(lambda o: o["spec"].pop("target")))
        self.assertTrue(any("a qemu source needs a qemu target on another node" in e for e in errs), errs)
        errs = self.errors(self.mutated(lambda o: o["spec"]["target"]["qemu"].update(node="node-a")))
        self.assertTrue(any("a qemu source needs a qemu target on another node" in e for e in errs), errs)

    def test_minimal_vmi_object_validates_and_cel_rules_refuse_mixed_kinds(self):
        minimal = {"apiVersion": "rdmig.io/v1alpha1", "kind": "RdmaMigration",
                   "metadata": {"name": "move-web-1", "namespace": "prod"}, "spec": {"source": {"vmi": {"name": "web-1"}}}}
        self.assertEqual(self.errors(minimal), [])
        both = copy.deepcopy(minimal)
        both["spec"]["source"]["qemu"] = {"node": "a", "qmpSocket": "/q"}
        self.assertTrue(any("name exactly one kind" in e for e in self.errors(both)))
        qemu_target = copy.deepcopy(self.vmi)
        qemu_target["spec"]["target"] = {"qemu": {"node": "b", "qmpSocket": "/q"}}
        self.assertTrue(any("not allowed with a vmi source" in e for e in self.errors(qemu_target)))
        tuned = copy.deepcopy(minimal)
        tuned["spec"]["chunkSize"] = "4Mi"
        self.assertTrue(any("only for a qemu source" in e for e in self.errors(tuned)))
        selector_on_qemu = self.mutated(lambda o: o["spec"]["target"].update(nodeSelector={"a": "b"}))
        self.assertTrue(self.errors(selector_on_qemu))
        bad_selector = copy.deepcopy(self.vmi)
        bad_selector["spec"]["target"]["nodeSelector"]["x"] = 5
        self.assertTrue(any("nodeSelector.x" in e for e in self.errors(bad_selector)))

    def test_spec_is_immutable_except_cancel(self):
        old = self.vmi
        cancelled = copy.deepcopy(old)
        cancelled["spec"]["cancel"] = True
        self.assertEqual(schema_validator.validate(cancelled, self.schema, old=old), [])
        for change in (lambda s: s["source"]["vmi"].update(name="other"), lambda s: s.pop("target"),
                       lambda s: s["target"]["nodeSelector"].update(x="y")):
            new = copy.deepcopy(old)
            change(new["spec"])
            errs = schema_validator.validate(new, self.schema, old=old)
            self.assertTrue(any("spec is immutable except spec.cancel" in e for e in errs), errs)
        tuned = self.mutated(lambda o: o["spec"].update(chunkSize="8Mi"))
        errs = schema_validator.validate(tuned, self.schema, old=self.good)
        self.assertTrue(any("immutable" in e for e in errs), errs)
        # On create (no old object) the transition rule does not apply.
        self.assertEqual(self.errors(tuned), [])

    def test_rejects_target_without_a_kind_or_with_two(self):
        errs = self.errors(self.mutated(lambda o: o["spec"].update(target={})))
        self.assertTrue(any("spec.target" in e and "at least 1" in e for e in errs), errs)
        two = {"qemu": {"node": "b", "qmpSocket": "/q"}, "vmi": {"name": "x"}}
        errs = self.errors(self.mutated(lambda o: o["spec"].update(target=two)))
        self.assertTrue(any("spec.target" in e for e in errs), errs)

    def test_rejects_out_of_range_tunables_and_wrong_types(self):
        cases = {"multifdChannels": 65, "ringDepth": 1, "maxDowntimeMs": 0, "completionTimeoutSeconds": 5}
        for key, value in cases.items():
            errs = self.errors(self.mutated(lambda o: o["spec"].update({key: value})))
            self.assertTrue(any("spec." + key in e for e in errs), (key, errs))
        errs = self.errors(self.mutated(lambda o: o["spec"].update(cancel="yes")))
        self.assertTrue(any("spec.cancel" in e for e in errs), errs)
        errs = self.errors(self.mutated(lambda o: o["spec"]["source"]["qemu"].update(qmpSocket="relative.sock")))
        self.assertTrue(any("qmpSocket" in e for e in errs), errs)
        errs = self.errors(self.mutated(lambda o: o["spec"]["source"]["qemu"].pop("node")))
        self.assertTrue(any("'node' is missing" in e for e in errs), errs)

    def test_post_copy_is_an_enum_with_thresholds_only_for_auto_and_only_for_a_qemu_source(self):
        for mode in ("never", "auto", "after"):
            self.assertEqual(self.errors(self.mutated(lambda o: o["spec"].update(postCopy=mode))), [], mode)
        auto = self.mutated(lambda o: o["spec"].update(postCopy="auto", postCopyAfterPasses=3, postCopyAfterSeconds=30))
        self.assertEqual(self.errors(auto), [])
        for change, field in ((dict(postCopy="sometimes"), "spec.postCopy"),
                              (dict(postCopy="auto", postCopyAfterPasses=1), "spec.postCopyAfterPasses"),
                              (dict(postCopy="auto", postCopyAfterSeconds=86401), "spec.postCopyAfterSeconds")):
            errs = self.errors(self.mutated(lambda o: o["spec"].update(change)))
            self.assertTrue(any(field in e for e in errs), (change, errs))
        for change in (dict(postCopy="after", postCopyAfterPasses=3), dict(postCopyAfterSeconds=3)):
            errs = self.errors(self.mutated(lambda o: o["spec"].update(change)))
            self.assertTrue(any("only with spec.postCopy auto" in e for e in errs), (change, errs))
        on_vmi = copy.deepcopy(self.vmi)
        on_vmi["spec"]["postCopy"] = "auto"
        self.assertTrue(any("only for a qemu source" in e for e in self.errors(on_vmi)))
        changed = self.mutated(lambda o: o["spec"].update(postCopy="after"))
        errs = schema_validator.validate(changed, self.schema, old=self.good)
        self.assertTrue(any("immutable" in e for e in errs), errs)

    def test_post_copy_preempt_needs_post_copy_and_is_immutable(self):
        for mode in ("auto", "after"):
            self.assertEqual(self.errors(self.mutated(lambda o: o["spec"].update(postCopy=mode, postCopyPreempt=True))), [])
        # With multifd too (QEMU 10.1+ on both nodes, which the source agent checks).
        self.assertEqual(self.errors(self.mutated(lambda o: o["spec"].update(postCopy="after", postCopyPreempt=True,
                                                                            multifdChannels=4))), [])
        self.assertEqual(self.errors(self.mutated(lambda o: o["spec"].update(postCopyPreempt=False))), [])
        for change in (dict(postCopyPreempt=True), dict(postCopy="never", postCopyPreempt=True)):
            errs = self.errors(self.mutated(lambda o: o["spec"].update(change)))
            self.assertTrue(any("spec.postCopyPreempt: only with spec.postCopy auto or after" in e for e in errs),
                            (change, errs))
        errs = self.errors(self.mutated(lambda o: o["spec"].update(postCopy="after", postCopyPreempt="yes")))
        self.assertTrue(any("postCopyPreempt" in e for e in errs), errs)
        on_vmi = copy.deepcopy(self.vmi)
        on_vmi["spec"]["postCopyPreempt"] = False
        self.assertTrue(any("only for a qemu source" in e for e in self.errors(on_vmi)))
        old = self.mutated(lambda o: o["spec"].update(postCopy="after"))
        changed = self.mutated(lambda o: o["spec"].update(postCopy="after", postCopyPreempt=True))
        errs = schema_validator.validate(changed, self.schema, old=old)
        self.assertTrue(any("immutable" in e for e in errs), errs)

    def test_max_downtime_is_a_duration_and_the_old_field_is_still_accepted(self):
        for good in ("300ms", "1.5s", "1m30s", "2000s", "500us", "1h"):  # the controller checks the range
            self.assertEqual(self.errors(self.mutated(lambda o: o["spec"].update(maxDowntime=good))), [], good)
        for bad in (300, "300", "300 ms", "-1s", "1d", "fast", "1.s"):
            errs = self.errors(self.mutated(lambda o: o["spec"].update(maxDowntime=bad)))
            self.assertTrue(any("spec.maxDowntime" in e for e in errs), (bad, errs))
        old = self.mutated(lambda o: o["spec"].update(maxDowntimeMs=100))
        self.assertEqual(self.errors(old), [], "maxDowntimeMs is still read in v1alpha1")
        both = self.mutated(lambda o: o["spec"].update(maxDowntime="100ms", maxDowntimeMs=100))
        self.assertTrue(any("not both" in e for e in self.errors(both)), self.errors(both))
        vmi = copy.deepcopy(self.vmi)
        vmi["spec"]["maxDowntime"] = "100ms"
        self.assertTrue(any("only for a qemu source" in e for e in self.errors(vmi)))
        # Part of the immutable spec.
        before = self.mutated(lambda o: o["spec"].update(maxDowntime="100ms"))
        after = self.mutated(lambda o: o["spec"].update(maxDowntime="200ms"))
        errs = schema_validator.validate(after, self.schema, old=before)
        self.assertTrue(any("immutable" in e for e in errs), errs)

    def test_max_bandwidth_is_an_integer_or_a_quantity(self):
        for good in (10737418240, 0, "10Gi", "500M", "0"):
            self.assertEqual(self.errors(self.mutated(lambda o: o["spec"].update(maxBandwidth=good))), [], good)
        for bad in (-1, 1.5, True, "10GB", "fast", "1.5Gi"):
            errs = self.errors(self.mutated(lambda o: o["spec"].update(maxBandwidth=bad)))
            self.assertTrue(any("spec.maxBandwidth" in e for e in errs), (bad, errs))
        prop = self.schema["properties"]["spec"]["properties"]["maxBandwidth"]
        self.assertTrue(prop.get("x-kubernetes-int-or-string"))
        self.assertNotIn("type", prop, "an int-or-string field has no type (structural schema rule)")

    def test_rejects_unknown_spec_field_and_bad_status_phase(self):
        errs = self.errors(self.mutated(lambda o: o["spec"].update(chunksize="4Mi")))
        self.assertTrue(any("spec.chunksize: unknown field" in e for e in errs), errs)
        errs = self.errors(self.mutated(lambda o: o.update(status={"phase": "Done"})))
        self.assertTrue(any("status.phase" in e for e in errs), errs)

    def test_conditions_are_a_list_map_by_type_and_a_duplicate_type_is_refused(self):
        schema = schema_validator.load_crd_schema(CRD)
        conds = schema["properties"]["status"]["properties"]["conditions"]
        self.assertEqual(conds["x-kubernetes-list-type"], "map")
        self.assertEqual(conds["x-kubernetes-list-map-keys"], ["type"])
        c = {"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-01T00:00:00Z", "reason": "R",
             "message": ""}
        self.assertEqual(schema_validator.validate([c, dict(c, type="Carried")], conds), [])
        errs = schema_validator.validate([c, dict(c, status="False")], conds)
        self.assertEqual(len(errs), 1, errs)
        self.assertIn("Duplicate value", errs[0])

    def test_validator_catches_what_it_claims(self):
        # The validator itself: each keyword can fail.
        v = schema_validator.validate
        self.assertTrue(v(5, {"type": "string"}))
        self.assertTrue(v("x", {"type": "string", "enum": ["a"]}))
        self.assertTrue(v(5, {"type": "integer", "maximum": 4}))
        self.assertTrue(v({}, {"type": "object", "required": ["a"]}))
        self.assertTrue(v([1, "a"], {"type": "array", "items": {"type": "integer"}}))
        self.assertTrue(v("1x", {"type": "string", "pattern": "^[0-9]+$"}))
        self.assertTrue(v(True, {"type": "integer"}))
        self.assertFalse(v("4Mi", {"x-kubernetes-int-or-string": True}))
        self.assertTrue(v({}, {"type": "object", "oneOf": []}))  # unsupported keyword is reported
        rule = {"type": "object", "x-kubernetes-validations": [{"rule": "self.a == 'x' && !has(self.b)", "message": "m"}]}
        self.assertEqual(v({"a": "x"}, rule), [])
        self.assertEqual(v({"a": "x", "b": 1}, rule), ["<root>: m"])
        self.assertEqual(v({"a": "y"}, rule), ["<root>: m"])
        self.assertTrue(v({}, {"type": "object", "x-kubernetes-validations": [{"rule": "self.size() > 1"}]}),
                        "CEL outside the supported subset is reported, not skipped")
        self.assertTrue(v({"m": 1}, {"type": "object", "additionalProperties": {"type": "string"}}))


if __name__ == "__main__":
    unittest.main()
