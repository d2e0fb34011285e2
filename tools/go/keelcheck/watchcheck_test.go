package main

import "testing"

func watcherWith(events []seenEvent, gaps [][2]int64) *watchChecker {
	w := &watchChecker{events: events, gaps: gaps}
	for _, e := range events {
		if e.rev > w.lastRev {
			w.lastRev = e.rev
		}
	}
	return w
}

func goodLog() *writeLog {
	l := newWriteLog()
	for i, v := range []string{"v1", "v2", "v3", "v4"} {
		l.attempt(v)
		l.acked("k", v, int64(i+2))
	}
	return l
}

func goodEvents() []seenEvent {
	return []seenEvent{{2, "k", "v1", true}, {3, "k", "v2", true}, {4, "k", "v3", true}, {5, "k", "v4", true}}
}

func TestWatchCheckerAcceptsACompleteHistory(t *testing.T) {
	finals := map[string]kvOutput{"k": {Found: true, Value: "v4"}}
	if a, _, _ := checkWatchers([]*watchChecker{watcherWith(goodEvents(), nil)}, goodLog(), 5, finals); a != 0 {
		t.Fatalf("%d anomalies in a good history", a)
	}
}

func TestWatchCheckerCatchesEachAnomaly(t *testing.T) {
	ev := goodEvents()
	finals := map[string]kvOutput{"k": {Found: true, Value: "v4"}}
	cases := map[string][]seenEvent{
		"missing":   {ev[0], ev[1], ev[3]},
		"duplicate": {ev[0], ev[1], ev[1], ev[2], ev[3]},
		"reordered": {ev[0], ev[2], ev[1], ev[3]},
		"phantom":   {ev[0], ev[1], ev[2], ev[3], {6, "k", "never", true}},
		"wrong rev": {ev[0], ev[1], {4, "k", "v4", true}, {5, "k", "v3", true}},
		"stalled":   {ev[0], ev[1]},
	}
	for name, events := range cases {
		if a, _, _ := checkWatchers([]*watchChecker{watcherWith(events, nil)}, goodLog(), 5, finals); a == 0 {
			t.Errorf("%s: no anomaly found", name)
		}
	}
	// Two watchers that disagree about a revision.
	other := []seenEvent{ev[0], {3, "k", "v9", true}}
	l := goodLog()
	l.attempt("v9")
	if a, _, _ := checkWatchers([]*watchChecker{watcherWith(goodEvents(), nil), watcherWith(other, [][2]int64{{4, 5}})}, l, 3, nil); a == 0 {
		t.Error("disagreement: no anomaly found")
	}
}

func TestWatchCheckerAllowsAnnouncedGaps(t *testing.T) {
	ev := goodEvents()
	// The server cancelled the watch at compact revision 4: revisions 2-3 were never offered.
	w := watcherWith([]seenEvent{ev[2], ev[3]}, [][2]int64{{1, 3}})
	if a, _, g := checkWatchers([]*watchChecker{w}, goodLog(), 5, nil); a != 0 || g != 1 {
		t.Fatalf("anomalies %d gaps %d, want 0 and 1", a, g)
	}
}
