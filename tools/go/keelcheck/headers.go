package main

// The header-revision invariants that etcd keeps and keel must keep too (issue 36 found a keel
// Range answer whose header.revision was below a returned key's mod_revision). Every
// acknowledged answer of the kv workload is recorded here with the member that gave it, its
// header revision and the largest mod_revision in its body. This record is kept apart from
// porcupine's history: it holds serializable reads too (which porcupine's linearizable model
// must not see), and it needs no model. After the run four checks read it:
//   - body: header.revision >= 1, and >= every mod_revision the answer carries (a range's kvs,
//     a put's prev_kv, every response nested in a txn, recursively);
//   - real time: a linearizable answer (put, linearizable get or range, txn, a CURP put that
//     was answered after it applied) to an operation called after another linearizable
//     operation returned has a header revision at least that other answer's;
//   - serializable: on one member, within one incarnation (no start of that member in
//     between), a serializable read called after another returned has a header revision at
//     least the other's;
//   - watch: an event that a member delivered is at a revision no higher than the header
//     revision of that member's answer (same incarnation) to any operation called after the
//     event was received.
// A CURP put acknowledged on the fast path was executed speculatively and its answer carries
// revision 0 (keel-curp's status::SPECULATIVE): such answers are counted and left out of every
// check. Nothing here talks to a server.

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// answerClass says which checks an answer takes part in.
type answerClass uint8

const (
	// classLinearizable: put, linearizable get or range, txn, applied CURP put.
	classLinearizable answerClass = iota
	// classSerializable: a serializable (member-local) get.
	classSerializable
	// classNoRevision: a CURP put acknowledged on the fast path with header revision 0.
	classNoRevision
)

// answer is one acknowledged answer. Times are the recorder's (ns since the workload started).
type answer struct {
	Op       string      `json:"op"`
	Key      string      `json:"key"`
	Client   int         `json:"client"`
	Call     int64       `json:"call_ns"`
	Return   int64       `json:"return_ns"`
	Member   uint64      `json:"member"` // header.member_id; 0 when the answer names none
	Rev      int64       `json:"rev"`    // header.revision
	MaxMod   int64       `json:"max_mod_rev,omitempty"`
	MaxModAt string      `json:"max_mod_at,omitempty"` // where in the body MaxMod is
	Class    answerClass `json:"class"`
}

func (a answer) String() string {
	return fmt.Sprintf("%s(%s) by client %d on member %x, called %s returned %s, header revision %d",
		a.Op, a.Key, a.Client, a.Member, fmtTime(a.Call), fmtTime(a.Return), a.Rev)
}

func fmtTime(ns int64) string {
	if ns == infinity {
		return "never"
	}
	return fmt.Sprintf("%.6fs", float64(ns)/1e9)
}

// answerLog collects answers from every client goroutine. A nil *answerLog ignores them.
type answerLog struct {
	mu   sync.Mutex
	list []answer
}

func (l *answerLog) add(a answer) {
	if l == nil {
		return
	}
	l.mu.Lock()
	l.list = append(l.list, a)
	l.mu.Unlock()
}

// newAnswer fills an answer's header fields and the largest mod_revision of resp's body.
func newAnswer(op, key string, client int, call, ret int64, h *pb.ResponseHeader, resp any, class answerClass) answer {
	a := answer{Op: op, Key: key, Client: client, Call: call, Return: ret, Class: class}
	if h != nil {
		a.Member, a.Rev = h.MemberId, h.Revision
	}
	visitModRevisions("", resp, func(at string, rev int64) {
		if a.MaxModAt == "" || rev > a.MaxMod {
			a.MaxMod, a.MaxModAt = rev, at
		}
	})
	return a
}

// visitModRevisions calls fn with every mod_revision in an answer's body and its path there.
func visitModRevisions(path string, resp any, fn func(at string, rev int64)) {
	switch r := resp.(type) {
	case *pb.RangeResponse:
		for i, kv := range r.GetKvs() {
			fn(fmt.Sprintf("%skvs[%d] (%s)", path, i, kv.Key), kv.ModRevision)
		}
	case *pb.PutResponse:
		if kv := r.GetPrevKv(); kv != nil {
			fn(fmt.Sprintf("%sprev_kv (%s)", path, kv.Key), kv.ModRevision)
		}
	case *pb.DeleteRangeResponse:
		for i, kv := range r.GetPrevKvs() {
			fn(fmt.Sprintf("%sprev_kvs[%d] (%s)", path, i, kv.Key), kv.ModRevision)
		}
	case *pb.TxnResponse:
		for i, op := range r.GetResponses() {
			at := fmt.Sprintf("%sresponses[%d].", path, i)
			switch {
			case op.GetResponseRange() != nil:
				visitModRevisions(at+"range.", op.GetResponseRange(), fn)
			case op.GetResponsePut() != nil:
				visitModRevisions(at+"put.", op.GetResponsePut(), fn)
			case op.GetResponseDeleteRange() != nil:
				visitModRevisions(at+"delete.", op.GetResponseDeleteRange(), fn)
			case op.GetResponseTxn() != nil:
				visitModRevisions(at+"txn.", op.GetResponseTxn(), fn)
			}
		}
	}
}

// incarnations holds, per member id, the times (recorder's clock) at which keelcheck started
// that member's process.
type incarnations map[uint64][]int64

// of returns which incarnation of member m answered an operation in [call, ret]: the number
// of starts at or before call. ok is false when the member is unknown or was started during
// the operation (the answering incarnation is then unclear).
func (in incarnations) of(m uint64, call, ret int64) (int, bool) {
	starts, known := in[m]
	if !known {
		return 0, false
	}
	k := sort.Search(len(starts), func(i int) bool { return starts[i] > call })
	if k < len(starts) && starts[k] <= ret {
		return k, false
	}
	return k, true
}

// checkBodies: every answer that carries a revision has one >= 1, and none below a
// mod_revision in its own body.
func checkBodies(as []answer) []string {
	var out []string
	for _, a := range as {
		if a.Class == classNoRevision {
			continue
		}
		if a.Rev < 1 {
			out = append(out, fmt.Sprintf("header revision %d < 1: %v", a.Rev, a))
		}
		if a.MaxModAt != "" && a.MaxMod > a.Rev {
			out = append(out, fmt.Sprintf("header revision %d below mod_revision %d of %s: %v", a.Rev, a.MaxMod, a.MaxModAt, a))
		}
	}
	return out
}

// monotone returns every answer b of as (one class, one scope) called after some answer a
// returned with a.Rev > b.Rev, naming the highest such a. O(n log n).
func monotone(as []answer, what string) []string {
	byRet := append([]answer(nil), as...)
	sort.SliceStable(byRet, func(i, j int) bool { return byRet[i].Return < byRet[j].Return })
	byCall := append([]answer(nil), as...)
	sort.SliceStable(byCall, func(i, j int) bool { return byCall[i].Call < byCall[j].Call })
	var out []string
	best, j := -1, 0
	for _, b := range byCall {
		for ; j < len(byRet) && byRet[j].Return < b.Call; j++ {
			if best < 0 || byRet[j].Rev > byRet[best].Rev {
				best = j
			}
		}
		if best >= 0 && b.Rev < byRet[best].Rev {
			a := byRet[best]
			out = append(out, fmt.Sprintf("%s: header revision went back from %d to %d: [%v] returned before [%v] was called",
				what, a.Rev, b.Rev, a, b))
		}
	}
	return out
}

// checkRealTime: linearizable answers, across keys and members, never go back in real time.
func checkRealTime(as []answer) []string {
	var lin []answer
	for _, a := range as {
		if a.Class == classLinearizable {
			lin = append(lin, a)
		}
	}
	return monotone(lin, "real time")
}

type memberIncarnation struct {
	member uint64
	inc    int
}

// checkSerializable: one member's serializable reads, within one incarnation, never go back
// in real time. It also returns how many serializable answers could be placed in an
// incarnation (the others: unknown member, or started while the read ran).
func checkSerializable(as []answer, in incarnations) (violations []string, placed int) {
	groups := map[memberIncarnation][]answer{}
	for _, a := range as {
		if a.Class != classSerializable {
			continue
		}
		k, ok := in.of(a.Member, a.Call, a.Return)
		if !ok {
			continue
		}
		placed++
		g := memberIncarnation{a.Member, k}
		groups[g] = append(groups[g], a)
	}
	for _, g := range sortedGroups(groups) {
		what := fmt.Sprintf("serializable reads on member %x (incarnation %d)", g.member, g.inc)
		violations = append(violations, monotone(groups[g], what)...)
	}
	return violations, placed
}

func sortedGroups[T any](m map[memberIncarnation]T) []memberIncarnation {
	keys := make([]memberIncarnation, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].member != keys[j].member {
			return keys[i].member < keys[j].member
		}
		return keys[i].inc < keys[j].inc
	})
	return keys
}

// watchReceipt is one watch response: the member that sent it (its header's member_id), when
// the watcher received it and its newest event's mod_revision.
type watchReceipt struct {
	Watcher int
	Member  uint64
	At      int64
	Rev     int64
}

// checkWatchHeaders: an answer (any with a revision) of member m to an operation called after
// a watcher received an event from the same incarnation of m has a header revision at least
// that event's mod_revision. Returns the violations and how many answers were compared with
// at least one event.
func checkWatchHeaders(rs []watchReceipt, as []answer, in incarnations) (violations []string, compared int) {
	events := map[memberIncarnation][]watchReceipt{}
	for _, r := range rs {
		if k, ok := in.of(r.Member, r.At, r.At); ok {
			g := memberIncarnation{r.Member, k}
			events[g] = append(events[g], r)
		}
	}
	answers := map[memberIncarnation][]answer{}
	for _, a := range as {
		if a.Class == classNoRevision {
			continue
		}
		if k, ok := in.of(a.Member, a.Call, a.Return); ok {
			g := memberIncarnation{a.Member, k}
			answers[g] = append(answers[g], a)
		}
	}
	for _, g := range sortedGroups(answers) {
		ev := events[g]
		sort.SliceStable(ev, func(i, j int) bool { return ev[i].At < ev[j].At })
		group := answers[g]
		sort.SliceStable(group, func(i, j int) bool { return group[i].Call < group[j].Call })
		best, j := -1, 0
		for _, a := range group {
			for ; j < len(ev) && ev[j].At < a.Call; j++ {
				if best < 0 || ev[j].Rev > ev[best].Rev {
					best = j
				}
			}
			if best < 0 {
				continue
			}
			compared++
			if e := ev[best]; a.Rev < e.Rev {
				violations = append(violations, fmt.Sprintf(
					"watch: watcher %d received an event at revision %d from member %x (incarnation %d) at %s, then [%v] was called and answered below it",
					e.Watcher, e.Rev, e.Member, g.inc, fmtTime(e.At), a))
			}
		}
	}
	return violations, compared
}

// headerReport is the outcome of every header check of one run.
type headerReport struct {
	answers, fastNoRev, fastWithRev     int
	body, realTime, serializable, watch []string
	serializablePlaced, watchCompared   int
}

func (h headerReport) violations() int {
	return len(h.body) + len(h.realTime) + len(h.serializable) + len(h.watch)
}

func checkHeaders(as []answer, rs []watchReceipt, in incarnations) headerReport {
	h := headerReport{answers: len(as)}
	for _, a := range as {
		switch {
		case a.Class == classNoRevision:
			h.fastNoRev++
		case a.Op == "curp-put-fast":
			h.fastWithRev++
		}
	}
	h.body = checkBodies(as)
	h.realTime = checkRealTime(as)
	h.serializable, h.serializablePlaced = checkSerializable(as, in)
	h.watch, h.watchCompared = checkWatchHeaders(rs, as, in)
	return h
}

// print writes every kind of violation (at most 10 each) to stderr and one summary line.
func (h headerReport) print() {
	for _, kind := range [][]string{h.body, h.realTime, h.serializable, h.watch} {
		for i, v := range kind {
			if i == 10 {
				fmt.Fprintf(os.Stderr, "keelcheck: header: ... and %d more of this kind\n", len(kind)-10)
				break
			}
			fmt.Fprintln(os.Stderr, "keelcheck: header:", v)
		}
	}
	fmt.Printf("keelcheck: header checks: answers=%d body=%d real-time=%d serializable=%d (of %d placed) watch=%d (of %d compared) curp-fast-without-revision=%d curp-fast-with-revision=%d\n",
		h.answers, len(h.body), len(h.realTime), len(h.serializable), h.serializablePlaced,
		len(h.watch), h.watchCompared, h.fastNoRev, h.fastWithRev)
}

func writeAnswers(path string, as []answer) {
	f, err := os.Create(path)
	if err != nil {
		fmt.Fprintln(os.Stderr, "keelcheck: answers:", err)
		return
	}
	defer f.Close()
	enc := json.NewEncoder(f)
	for _, a := range as {
		_ = enc.Encode(a)
	}
}
