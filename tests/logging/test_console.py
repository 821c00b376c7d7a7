"""The console: jaxvrl's INFO messages reach stderr although absl (imported with orbax)
configured the root logger at WARNING first; other libraries' INFO messages stay hidden."""

import subprocess
import sys


def test_info_messages_show_after_absl_configured_the_root_logger():
    code = (
        "import logging, orbax.checkpoint\n"
        "from jaxvrl.logging import show_logs\n"
        "show_logs()\n"
        "logging.getLogger('jaxvrl').info('planned 3 shapes')\n"
        "logging.getLogger('jax').info('library chatter')\n"
        "logging.getLogger('jaxvrl').debug('debug detail')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "planned 3 shapes" in out.stderr
    assert "library chatter" not in out.stderr and "debug detail" not in out.stderr
