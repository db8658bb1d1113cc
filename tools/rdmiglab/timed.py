"""unittest.main() that also prints each case's wall time after the run, slowest first, so that a
row's log says where its time goes (the suite's profile, README "How long the suite takes").

    from rdmiglab import timed
    timed.main()                      # as unittest.main(), same arguments and exit status

The table goes to the runner's stream (stderr) after unittest's own summary; it changes no result.
What the cases' own time does not explain (setUpClass, module fixtures) is printed as "fixtures".
"""
import time
import unittest

_SHOWN = 15  # the slowest cases listed; the rest are summed


class _TimedResult(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.case_times = []
        self._started = None

    def startTest(self, test):
        self._started = time.monotonic()
        super().startTest(test)

    def stopTest(self, test):
        super().stopTest(test)
        if self._started is not None:
            self.case_times.append((time.monotonic() - self._started, test.id().rsplit(".", 2)[-1]))
            self._started = None


class _TimedRunner(unittest.TextTestRunner):
    resultclass = _TimedResult

    def run(self, test):
        began = time.monotonic()
        result = super().run(test)
        total = time.monotonic() - began
        times = sorted(getattr(result, "case_times", []), reverse=True)
        if times:
            cases = sum(t for t, _ in times)
            self.stream.writeln("case times (s), slowest first, of %d case(s) in %.1f s:" % (len(times), total))
            for t, name in times[:_SHOWN]:
                self.stream.writeln("  %7.1f  %s" % (t, name))
            if len(times) > _SHOWN:
                self.stream.writeln("  %7.1f  the other %d case(s)" % (sum(t for t, _ in times[_SHOWN:]),
                                                                     len(times) - _SHOWN))
            self.stream.writeln("  %7.1f  fixtures (setUpClass, tearDownClass, module)" % max(0.0, total - cases))
            self.stream.flush()
        return result


def main(**kwargs):
    kwargs.setdefault("testRunner", _TimedRunner)
    return unittest.main(module="__main__", **kwargs)
