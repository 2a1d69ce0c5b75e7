import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "integration"))  # test_resume's run-log helpers
