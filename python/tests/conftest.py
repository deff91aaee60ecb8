import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_report_header(config):
    import hybridep
    return "hybridep package %s, library %s" % (os.path.dirname(hybridep.__file__),
                                                hybridep.library_path)
