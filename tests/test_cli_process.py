"""The suite's forked processes (cli_process.py) start from a server that did the one-off work once."""
import pytest


@pytest.mark.slow  # starts this test process's fork server where no test has yet
def test_a_forked_process_starts_with_numba_set_up_by_the_server():
    """forkserver_warmup.py ran in the server (tests/ on its path: 3.11's forkserver ignores the caller's sys.path,
    and an ImportError of a preloaded module is silent), so the process holds the accumulators' CPU pass loaded."""
    import forkserver_warmup
    from cli_process import _context, ensure_server

    ensure_server()
    with _context.Pool(1) as pool:
        assert pool.apply(forkserver_warmup.warmed_before_the_fork)
