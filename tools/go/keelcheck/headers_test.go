package main

import (
	"strings"
	"testing"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"google.golang.org/protobuf/encoding/protowire"
)

const (
	memberA = uint64(0xa)
	memberB = uint64(0xb)
)

func hdr(member uint64, rev int64) *pb.ResponseHeader {
	return &pb.ResponseHeader{MemberId: member, Revision: rev}
}

func kv(key string, mod int64) *mvccpb.KeyValue {
	return &mvccpb.KeyValue{Key: []byte(key), ModRevision: mod, CreateRevision: 1, Version: 1}
}

func rangeResp(rev int64, mods ...int64) *pb.RangeResponse {
	r := &pb.RangeResponse{Header: hdr(memberA, rev)}
	for _, m := range mods {
		r.Kvs = append(r.Kvs, kv("k", m))
	}
	return r
}

// lin, ser: a linearizable or serializable answer of member m in [call, ret] at revision rev.
func lin(m uint64, call, ret, rev int64) answer {
	return answer{Op: "get", Key: "k", Member: m, Call: call, Return: ret, Rev: rev, Class: classLinearizable}
}

func ser(m uint64, call, ret, rev int64) answer {
	a := lin(m, call, ret, rev)
	a.Op, a.Class = "serializable-get", classSerializable
	return a
}

func TestBodyCheck(t *testing.T) {
	nested := &pb.TxnResponse{Header: hdr(memberA, 8), Responses: []*pb.ResponseOp{
		{Response: &pb.ResponseOp_ResponsePut{ResponsePut: &pb.PutResponse{}}},
		{Response: &pb.ResponseOp_ResponseTxn{ResponseTxn: &pb.TxnResponse{Responses: []*pb.ResponseOp{
			{Response: &pb.ResponseOp_ResponseRange{ResponseRange: rangeResp(0, 3, 9)}},
		}}}},
	}}
	cases := []struct {
		name  string
		a     answer
		want  int
		where string
	}{
		{"range at its newest key", newAnswer("get", "k", 0, 0, 1, hdr(memberA, 5), rangeResp(5, 2, 5), classLinearizable), 0, ""},
		{"empty range", newAnswer("get", "k", 0, 0, 1, hdr(memberA, 5), rangeResp(5), classLinearizable), 0, ""},
		{"range below a key (issue 36)", newAnswer("get", "k", 0, 0, 1, hdr(memberA, 4), rangeResp(4, 2, 5), classLinearizable), 1, "kvs[1]"},
		{"put below its prev_kv", newAnswer("put+prev_kv", "k", 0, 0, 1, hdr(memberA, 6), &pb.PutResponse{PrevKv: kv("k", 7)}, classLinearizable), 1, "prev_kv"},
		{"put above its prev_kv", newAnswer("put+prev_kv", "k", 0, 0, 1, hdr(memberA, 8), &pb.PutResponse{PrevKv: kv("k", 7)}, classLinearizable), 0, ""},
		{"txn below a range nested in a txn", newAnswer("cas", "k", 0, 0, 1, nested.Header, nested, classLinearizable), 1, "responses[1].txn.responses[0].range.kvs[1]"},
		{"no header", newAnswer("get", "k", 0, 0, 1, nil, rangeResp(0), classLinearizable), 1, "< 1"},
		{"serializable at revision 0", newAnswer("serializable-get", "k", 0, 0, 1, hdr(memberA, 0), rangeResp(0), classSerializable), 1, "< 1"},
		{"fast CURP answer without a revision", newAnswer("curp-put-fast", "k", 0, 0, 1, hdr(0, 0), &pb.PutResponse{}, classNoRevision), 0, ""},
	}
	for _, c := range cases {
		got := checkBodies([]answer{c.a})
		if len(got) != c.want {
			t.Errorf("%s: %d violations, want %d: %v", c.name, len(got), c.want, got)
			continue
		}
		if c.want > 0 && !strings.Contains(got[0], c.where) {
			t.Errorf("%s: violation %q does not name %q", c.name, got[0], c.where)
		}
	}
}

func TestRealTimeCheck(t *testing.T) {
	cases := []struct {
		name string
		h    []answer
		want int
	}{
		{"sequential, across members", []answer{lin(memberA, 0, 1, 5), lin(memberB, 2, 3, 5), lin(memberA, 4, 5, 7)}, 0},
		{"concurrent answers may be in any order", []answer{lin(memberA, 0, 10, 7), lin(memberB, 1, 2, 5), lin(memberB, 3, 4, 6)}, 0},
		{"a later call answered lower", []answer{lin(memberA, 0, 1, 5), lin(memberB, 2, 3, 4)}, 1},
		{"two later calls answered lower", []answer{lin(memberA, 0, 1, 9), lin(memberB, 2, 3, 4), lin(memberA, 5, 6, 8)}, 2},
		{"called at the instant the other returned", []answer{lin(memberA, 0, 2, 5), lin(memberB, 2, 3, 4)}, 0},
		{"serializable reads are not in it", []answer{lin(memberA, 0, 1, 5), ser(memberB, 2, 3, 4)}, 0},
		{"fast CURP answers are not in it", []answer{lin(memberA, 0, 1, 5), {Op: "curp-put-fast", Call: 2, Return: 3, Class: classNoRevision}}, 0},
	}
	for _, c := range cases {
		if got := checkRealTime(c.h); len(got) != c.want {
			t.Errorf("%s: %d violations, want %d: %v", c.name, len(got), c.want, got)
		}
	}
	got := checkRealTime([]answer{lin(memberA, 0, 1, 5), lin(memberB, 2, 3, 4)})
	for _, part := range []string{"from 5 to 4", "member a", "member b", "returned 0.000000s", "called 0.000000s"} {
		if !strings.Contains(got[0], part) {
			t.Errorf("report %q does not say %q", got[0], part)
		}
	}
}

func TestIncarnations(t *testing.T) {
	in := incarnations{memberA: {-5, 10, 20}}
	cases := []struct {
		call, ret int64
		want      int
		ok        bool
	}{
		{0, 5, 1, true}, {10, 15, 2, true}, {5, 10, 1, false}, {9, 25, 1, false}, {30, 40, 3, true},
	}
	for _, c := range cases {
		if k, ok := in.of(memberA, c.call, c.ret); k != c.want || ok != c.ok {
			t.Errorf("of(%d, %d) = %d %v, want %d %v", c.call, c.ret, k, ok, c.want, c.ok)
		}
	}
	if _, ok := in.of(memberB, 0, 1); ok {
		t.Error("an unknown member has a known incarnation")
	}
}

func TestSerializableCheck(t *testing.T) {
	in := incarnations{memberA: {-1, 100}, memberB: {-1}}
	cases := []struct {
		name         string
		h            []answer
		want, placed int
	}{
		{"one member, rising", []answer{ser(memberA, 0, 1, 5), ser(memberA, 2, 3, 5), ser(memberA, 4, 5, 6)}, 0, 3},
		{"one member goes back", []answer{ser(memberA, 0, 1, 5), ser(memberA, 2, 3, 4)}, 1, 2},
		{"overlapping reads may be in any order", []answer{ser(memberA, 0, 5, 5), ser(memberA, 1, 2, 4)}, 0, 2},
		{"another member may lag", []answer{ser(memberA, 0, 1, 5), ser(memberB, 2, 3, 4)}, 0, 2},
		{"a restart in between", []answer{ser(memberA, 0, 1, 5), ser(memberA, 101, 102, 4)}, 0, 2},
		{"started while it read", []answer{ser(memberA, 0, 1, 5), ser(memberA, 99, 101, 4)}, 0, 1},
		{"an unknown member", []answer{ser(0xc, 0, 1, 5), ser(0xc, 2, 3, 4)}, 0, 0},
		{"linearizable answers are not in it", []answer{lin(memberA, 0, 1, 5), ser(memberA, 2, 3, 4)}, 0, 1},
	}
	for _, c := range cases {
		got, placed := checkSerializable(c.h, in)
		if len(got) != c.want || placed != c.placed {
			t.Errorf("%s: %d violations (%d placed), want %d (%d): %v", c.name, len(got), placed, c.want, c.placed, got)
		}
	}
}

func TestWatchHeaderCheck(t *testing.T) {
	in := incarnations{memberA: {-1, 100}, memberB: {-1}}
	ev := watchReceipt{Watcher: 1, Member: memberA, At: 10, Rev: 9}
	cases := []struct {
		name           string
		rs             []watchReceipt
		h              []answer
		want, compared int
	}{
		{"answered at the event", []watchReceipt{ev}, []answer{lin(memberA, 11, 12, 9), ser(memberA, 13, 14, 10)}, 0, 2},
		{"serializable read below a received event", []watchReceipt{ev}, []answer{ser(memberA, 11, 12, 8)}, 1, 1},
		{"linearizable read below a received event", []watchReceipt{ev}, []answer{lin(memberA, 11, 12, 8)}, 1, 1},
		{"called before the event arrived", []watchReceipt{ev}, []answer{ser(memberA, 9, 12, 8)}, 0, 0},
		{"another member", []watchReceipt{ev}, []answer{ser(memberB, 11, 12, 8)}, 0, 0},
		{"a restart in between", []watchReceipt{ev}, []answer{ser(memberA, 101, 102, 8)}, 0, 0},
		{"the newest event counts", []watchReceipt{ev, {Member: memberA, At: 5, Rev: 3}}, []answer{ser(memberA, 11, 12, 8)}, 1, 1},
	}
	for _, c := range cases {
		got, compared := checkWatchHeaders(c.rs, c.h, in)
		if len(got) != c.want || compared != c.compared {
			t.Errorf("%s: %d violations (%d compared), want %d (%d): %v", c.name, len(got), compared, c.want, c.compared, got)
		}
	}
}

func TestCheckHeadersCountsEveryKind(t *testing.T) {
	as := []answer{
		newAnswer("get", "k", 0, 0, 1, hdr(memberA, 4), rangeResp(4, 5), classLinearizable), // body
		lin(memberB, 2, 3, 3), // real time: below 4
		ser(memberA, 4, 5, 7),
		ser(memberA, 6, 7, 6), // serializable: below 7
		{Op: "curp-put-fast", Call: 8, Return: 9, Class: classNoRevision},
	}
	rs := []watchReceipt{{Member: memberB, At: 1, Rev: 4}} // watch: answer of b at 3 after an event at 4
	h := checkHeaders(as, rs, incarnations{memberA: {-1}, memberB: {-1}})
	if len(h.body) != 1 || len(h.realTime) != 1 || len(h.serializable) != 1 || len(h.watch) != 1 || h.fastNoRev != 1 {
		t.Fatalf("body %v real-time %v serializable %v watch %v fast %d", h.body, h.realTime, h.serializable, h.watch, h.fastNoRev)
	}
	if h.violations() != 4 {
		t.Fatalf("violations() = %d, want 4", h.violations())
	}
}

// A CURP reply's result is an etcd PutResponse in a length-delimited field; the fast path's
// answer carries header revision 0.
func TestCurpPutResult(t *testing.T) {
	want := &pb.PutResponse{Header: &pb.ResponseHeader{Revision: 42}, PrevKv: kv("k", 41)}
	body, err := want.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	var reply []byte
	reply = protowire.AppendTag(reply, 1, protowire.VarintType)
	reply = protowire.AppendVarint(reply, curpSynced)
	reply = protowire.AppendTag(reply, 4, protowire.BytesType)
	reply = protowire.AppendBytes(reply, body)
	reply = protowire.AppendTag(reply, 5, protowire.BytesType)
	reply = protowire.AppendBytes(reply, protowire.AppendVarint(nil, 7))
	got, err := putResult(reply, 4)
	if err != nil || got.GetHeader().GetRevision() != 42 || got.GetPrevKv().ModRevision != 41 {
		t.Fatalf("putResult = %v, %v", got, err)
	}
	empty, err := putResult(reply[:2], 4) // no result field: an empty answer, revision 0
	if err != nil || empty.GetHeader().GetRevision() != 0 {
		t.Fatalf("putResult without a result = %v, %v", empty, err)
	}
	if _, err := putResult(reply[:6], 4); err == nil {
		t.Fatal("a truncated reply decoded")
	}
}
