package main

import (
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

func op(client int, call, ret int64, in kvInput, out kvOutput) porcupine.Operation {
	if out.Unknown {
		ret = infinity
	}
	return porcupine.Operation{ClientId: client, Call: call, Return: ret, Input: in, Output: out}
}

func put(k, v string) kvInput      { return kvInput{Kind: opPut, Key: k, Value: v} }
func get(k string) kvInput         { return kvInput{Kind: opGet, Key: k} }
func cas(k, exp, v string) kvInput { return kvInput{Kind: opCAS, Key: k, Expect: exp, Value: v} }
func saw(v string) kvOutput        { return kvOutput{Found: true, Value: v} }

var (
	done    = kvOutput{}
	absent  = kvOutput{}
	swapped = kvOutput{Succeeded: true}
	unknown = kvOutput{Unknown: true}
)

func linearizable(h []porcupine.Operation) bool {
	return porcupine.CheckOperationsTimeout(kvModel, pruneHistory(h), 10*time.Second) == porcupine.Ok
}

func TestModel(t *testing.T) {
	cases := []struct {
		name string
		want bool
		h    []porcupine.Operation
	}{
		{"sequential put then get", true, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(0, 2, 3, get("a"), saw("1")),
		}},
		{"stale read after an acknowledged put", false, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(0, 2, 3, put("a", "2"), done),
			op(1, 4, 5, get("a"), saw("1")),
		}},
		{"read of a value never written", false, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(1, 2, 3, get("a"), saw("9")),
		}},
		{"concurrent put may or may not be seen", true, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(0, 2, 10, put("a", "2"), done),
			op(1, 3, 4, get("a"), saw("1")),
			op(2, 5, 6, get("a"), saw("2")),
		}},
		{"reads go backwards", false, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(0, 2, 10, put("a", "2"), done),
			op(1, 3, 4, get("a"), saw("2")),
			op(2, 5, 6, get("a"), saw("1")),
		}},
		{"absent before any write", true, []porcupine.Operation{
			op(1, 0, 1, get("a"), absent),
			op(0, 2, 3, put("a", "1"), done),
		}},
		{"lost acknowledged write: absent after put", false, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(1, 2, 3, get("a"), absent),
		}},
		{"unknown put may take effect late", true, []porcupine.Operation{
			op(0, 0, 0, put("a", "1"), unknown),
			op(1, 5, 6, get("a"), absent),
			op(1, 7, 8, get("a"), saw("1")),
		}},
		{"unknown put cannot take effect before its call", false, []porcupine.Operation{
			op(1, 0, 1, get("a"), saw("1")),
			op(0, 2, 0, put("a", "1"), unknown),
		}},
		{"cas succeeds on a match", true, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(1, 2, 3, cas("a", "1", "2"), swapped),
			op(1, 4, 5, get("a"), saw("2")),
		}},
		{"cas cannot succeed on a mismatch", false, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(1, 2, 3, cas("a", "0", "2"), swapped),
		}},
		{"cas on a missing key fails and reads absent", true, []porcupine.Operation{
			op(1, 0, 1, cas("a", "x", "2"), absent),
		}},
		{"failed cas must report the current value", false, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(1, 2, 3, cas("a", "0", "2"), saw("0")),
		}},
		{"two successful cas from the same value", false, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(1, 2, 5, cas("a", "1", "2"), swapped),
			op(2, 2, 5, cas("a", "1", "3"), swapped),
		}},
		{"keys are independent", true, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(0, 2, 3, put("b", "2"), done),
			op(1, 4, 5, get("a"), saw("1")),
			op(1, 6, 7, get("b"), saw("2")),
		}},
		{"unknown get is ignored", true, []porcupine.Operation{
			op(0, 0, 1, put("a", "1"), done),
			op(1, 2, 0, get("a"), unknown),
		}},
	}
	for _, c := range cases {
		if got := linearizable(c.h); got != c.want {
			t.Errorf("%s: linearizable=%v, want %v", c.name, got, c.want)
		}
	}
}

func TestPruneKeepsObservedUnknownWrites(t *testing.T) {
	h := []porcupine.Operation{
		op(0, 0, 0, put("a", "1"), unknown), // observed below: kept
		op(0, 1, 0, put("a", "2"), unknown), // never observed: dropped
		op(0, 2, 0, get("a"), unknown),      // failed read: dropped
		op(1, 3, 4, get("a"), saw("1")),
	}
	p := pruneHistory(h)
	if len(p) != 2 || p[0].Input.(kvInput).Value != "1" {
		t.Fatalf("pruned to %v", p)
	}
}

func TestLostWrites(t *testing.T) {
	h := []porcupine.Operation{
		op(0, 0, 1, put("a", "1"), done),
		op(0, 2, 3, put("a", "2"), done),
		op(0, 4, 0, put("a", "3"), unknown),
		op(0, 5, 6, put("b", "4"), done),
	}
	if l := lostWrites(h, map[string]kvOutput{"a": saw("2"), "b": saw("4")}); len(l) != 0 {
		t.Errorf("no loss expected, got %v", l)
	}
	if l := lostWrites(h, map[string]kvOutput{"a": saw("3"), "b": saw("4")}); len(l) != 0 {
		t.Errorf("an unknown write may be last, got %v", l)
	}
	if l := lostWrites(h, map[string]kvOutput{"a": saw("1"), "b": saw("4")}); len(l) != 1 {
		t.Errorf("put 2 lost, got %v", l)
	}
	if l := lostWrites(h, map[string]kvOutput{"a": saw("2"), "b": absent}); len(l) != 1 {
		t.Errorf("b lost, got %v", l)
	}
	if l := lostWrites(h, map[string]kvOutput{"a": saw("x"), "b": saw("4")}); len(l) != 1 {
		t.Errorf("a value never written, got %v", l)
	}
}
