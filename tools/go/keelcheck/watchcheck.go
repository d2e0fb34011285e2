package main

// keelcheck fault --watchers N: N watchers of the whole key space of the kv workload, from
// revision 1, each starting on a different member and resumed by clientv3 wherever its stream
// breaks (member killed, partitioned). Their events are checked against the writes the
// workload made:
//   - order: a watcher's revisions strictly increase (the workload writes one key per
//     revision), so a duplicated or reordered event is caught;
//   - no phantom: every event's value is one a client tried to write (values are unique);
//   - agreement: an acknowledged write's event carries its key and acknowledged revision, and
//     every watcher that saw a revision saw the same event there;
//   - none missing: every acknowledged write whose revision a watcher covered (from 1 to the
//     last revision it reached, minus the gaps the server announced by cancelling the watch
//     with a compact revision) is among that watcher's events;
//   - catch up: after the run each watcher reaches the cluster's final revision, and its last
//     event per key is the value the final linearizable read returned.
// A gap is not an anomaly when the server says so (etcd's ErrCompacted: the watcher resumes at
// the compact revision); gaps are counted and printed.

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// writeLog is what the workload tried to write and which writes were acknowledged at which
// revision. A nil *writeLog ignores everything.
type writeLog struct {
	mu        sync.Mutex
	attempted map[string]bool
	ackedAt   map[string]ackedWrite // value -> key, revision
}

type ackedWrite struct {
	key string
	rev int64
}

func newWriteLog() *writeLog {
	return &writeLog{attempted: map[string]bool{}, ackedAt: map[string]ackedWrite{}}
}

func (w *writeLog) attempt(value string) {
	if w == nil {
		return
	}
	w.mu.Lock()
	w.attempted[value] = true
	w.mu.Unlock()
}

func (w *writeLog) acked(key, value string, rev int64) {
	if w == nil {
		return
	}
	w.mu.Lock()
	w.ackedAt[value] = ackedWrite{key, rev}
	w.mu.Unlock()
}

type seenEvent struct {
	rev        int64
	key, value string
	isPut      bool
}

type watchChecker struct {
	id        int
	endpoints []string
	prefix    string
	mu        sync.Mutex
	events    []seenEvent
	gaps      [][2]int64 // revisions [from, to] the server said it could not deliver
	lastRev   int64      // the newest revision delivered
	anomalies []string
	restarts  int // watches opened again after the channel ended
	// now is the recorder's clock; receipts (one per watch response with events) say which
	// member sent what when, for the header checks (headers.go).
	now      func() int64
	receipts []watchReceipt
}

func (w *watchChecker) anomaly(format string, args ...any) {
	w.anomalies = append(w.anomalies, fmt.Sprintf("watcher %d: ", w.id)+fmt.Sprintf(format, args...))
}

// run watches until ctx ends.
func (w *watchChecker) run(ctx context.Context) {
	defer guard()
	cli, err := newClient(w.endpoints, 2*time.Second)
	if err != nil {
		w.mu.Lock()
		w.anomaly("client: %v", err)
		w.mu.Unlock()
		return
	}
	defer cli.Close()
	next := int64(1)
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(ctx)
		ch := cli.Watch(wctx, w.prefix, clientv3.WithPrefix(), clientv3.WithRev(next))
		for resp := range ch {
			at := w.now()
			w.mu.Lock()
			if resp.CompactRevision > 0 {
				if resp.CompactRevision > next {
					w.gaps = append(w.gaps, [2]int64{next, resp.CompactRevision - 1})
					next = resp.CompactRevision
				}
				w.mu.Unlock()
				break
			}
			newest := int64(0)
			for _, ev := range resp.Events {
				newest = max(newest, ev.Kv.ModRevision)
				e := seenEvent{rev: ev.Kv.ModRevision, key: string(ev.Kv.Key), value: string(ev.Kv.Value), isPut: ev.Type == clientv3.EventTypePut}
				if e.rev < next {
					w.anomaly("event at revision %d before the watch's start %d", e.rev, next)
				}
				w.events = append(w.events, e)
				if e.rev > w.lastRev {
					w.lastRev = e.rev
				}
				next = e.rev + 1
			}
			if len(resp.Events) > 0 {
				w.receipts = append(w.receipts, watchReceipt{Watcher: w.id, Member: resp.Header.MemberId, At: at, Rev: newest})
			}
			w.mu.Unlock()
		}
		cancel()
		w.mu.Lock()
		w.restarts++
		w.mu.Unlock()
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (w *watchChecker) covered(rev int64) bool {
	if rev > w.lastRev {
		return false
	}
	for _, g := range w.gaps {
		if rev >= g[0] && rev <= g[1] {
			return false
		}
	}
	return true
}

// startWatchers starts n watchers, watcher i first connected to member i mod members; now
// times their receipts.
func startWatchers(ctx context.Context, n int, endpoints []string, prefix string, now func() int64) []*watchChecker {
	var ws []*watchChecker
	for i := 0; i < n; i++ {
		eps := append(append([]string{}, endpoints[i%len(endpoints):]...), endpoints[:i%len(endpoints)]...)
		w := &watchChecker{id: i, endpoints: eps, prefix: prefix, now: now}
		ws = append(ws, w)
		go w.run(ctx)
	}
	return ws
}

// waitCaughtUp waits (bounded) until every watcher delivered revision rev.
func waitCaughtUp(ws []*watchChecker, rev int64, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		done := true
		for _, w := range ws {
			w.mu.Lock()
			done = done && w.lastRev >= rev
			w.mu.Unlock()
		}
		if done {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// checkWatchers returns the anomalies of every watcher (printed, at most 10 each) and the
// total events and gaps.
func checkWatchers(ws []*watchChecker, log *writeLog, finalRev int64, finals map[string]kvOutput) (anomalies, events, gaps int) {
	log.mu.Lock()
	defer log.mu.Unlock()
	byRev := map[int64]seenEvent{}
	for _, w := range ws {
		w.mu.Lock()
		if w.lastRev < finalRev {
			w.anomaly("reached revision %d, the cluster is at %d", w.lastRev, finalRev)
		}
		seen := map[string]seenEvent{} // value -> event
		last := map[string]seenEvent{} // key -> newest event
		prev := int64(0)
		for _, e := range w.events {
			if e.rev <= prev {
				w.anomaly("event at revision %d (%s=%s) after revision %d: duplicated or reordered", e.rev, e.key, e.value, prev)
			}
			prev = e.rev
			if !e.isPut {
				w.anomaly("delete event of %s at %d: the workload never deletes", e.key, e.rev)
				continue
			}
			if !log.attempted[e.value] {
				w.anomaly("phantom event %s=%s at revision %d: no client wrote that value", e.key, e.value, e.rev)
			}
			if a, ok := log.ackedAt[e.value]; ok && (a.rev != e.rev || a.key != e.key) {
				w.anomaly("event %s=%s at revision %d; the write was acknowledged as %s at %d", e.key, e.value, e.rev, a.key, a.rev)
			}
			if o, ok := byRev[e.rev]; ok && (o.key != e.key || o.value != e.value) {
				w.anomaly("revision %d is %s=%s here and %s=%s at another watcher", e.rev, e.key, e.value, o.key, o.value)
			}
			byRev[e.rev] = e
			seen[e.value] = e
			last[e.key] = e
		}
		missing := 0
		var values []string
		for v := range log.ackedAt {
			values = append(values, v)
		}
		sort.Strings(values)
		for _, v := range values {
			a := log.ackedAt[v]
			if _, ok := seen[v]; !ok && w.covered(a.rev) {
				missing++
				if missing <= 5 {
					w.anomaly("acknowledged write %s=%s at revision %d is missing", a.key, v, a.rev)
				}
			}
		}
		if missing > 5 {
			w.anomaly("... %d acknowledged writes missing in all", missing)
		}
		if len(w.gaps) == 0 && w.lastRev >= finalRev {
			for k, f := range finals {
				e, ok := last[k]
				if f.Found != ok || (ok && e.value != f.Value) {
					w.anomaly("last event of %s is %q (seen %v); the final read returned %q (found %v)", k, e.value, ok, f.Value, f.Found)
				}
			}
		}
		for i, a := range w.anomalies {
			if i == 10 {
				fmt.Printf("keelcheck: watch: ... and %d more\n", len(w.anomalies)-10)
				break
			}
			fmt.Println("keelcheck: watch:", a)
		}
		var g []string
		for _, x := range w.gaps {
			g = append(g, fmt.Sprintf("%d-%d", x[0], x[1]))
		}
		fmt.Printf("keelcheck: watcher %d: %d events up to revision %d, %d restarts, gaps [%s]\n", w.id, len(w.events), w.lastRev, w.restarts, strings.Join(g, " "))
		anomalies += len(w.anomalies)
		events += len(w.events)
		gaps += len(w.gaps)
		w.mu.Unlock()
	}
	return anomalies, events, gaps
}

// allReceipts returns every watcher's receipts.
func allReceipts(ws []*watchChecker) []watchReceipt {
	var out []watchReceipt
	for _, w := range ws {
		w.mu.Lock()
		out = append(out, w.receipts...)
		w.mu.Unlock()
	}
	return out
}

// injectWatchBug (--inject-bug watch-drop / watch-dup) damages what w received, after the
// run, to show that the check catches a skipped or repeated event.
func injectWatchBug(kind string, w *watchChecker) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.events) < 3 {
		return
	}
	mid := len(w.events) / 2
	switch kind {
	case "watch-drop":
		w.events = append(w.events[:mid], w.events[mid+1:]...)
	case "watch-dup":
		w.events = append(w.events[:mid+1], w.events[mid:]...)
	}
}
