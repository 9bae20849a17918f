"""A Pacer draws a group of throttles one at a time, round robin, each one's last request always
(a dashboard's four views drawing together kept the page from answering for 1-2 s)."""
import threading
import time

from clover_lab.widgets.throttle import Pacer, Throttle


def test_one_draw_at_a_time_in_turn_and_the_last_request_drawn():
    drawn, active, overlap = [], [0], []
    lock = threading.Lock()

    def drawer(name):
        def draw():
            with lock:
                active[0] += 1
                overlap.append(active[0])
            drawn.append(name)
            time.sleep(0.01)
            with lock:
                active[0] -= 1
        return draw

    throttles = {name: Throttle(drawer(name), fps=1000) for name in ("a", "b", "c")}
    pacer = Pacer(throttles, ["a", "b", "a", "c"], gap=0.02)
    try:
        for _ in range(20):  # every view asks all the time: none draws out of turn
            for t in throttles.values():
                t.request()
            time.sleep(0.005)
        assert not drawn or drawn[0] == "a"
        deadline = time.time() + 5
        while any(t.pending for t in throttles.values()) and time.time() < deadline:
            time.sleep(0.01)
        assert not any(t.pending for t in throttles.values()), "a last request was never drawn"
        assert max(overlap) == 1, "two views drew at once"
        assert drawn.count("a") >= drawn.count("b") and set(drawn) == {"a", "b", "c"}
        assert len(drawn) < 60, f"{len(drawn)} draws for 60 requests: nothing was coalesced"
    finally:
        pacer.close()
    assert all(t.pacer is None for t in throttles.values())
    throttles["b"].request()  # after close, a throttle draws on its own again
    assert drawn[-1] == "b"
