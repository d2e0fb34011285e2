package main

// The sequential specification that histories are checked against: one register per key
// holding "absent" or a value, with put, get and compare-and-swap. Written for keelcheck;
// partitioned per key so porcupine checks each key on its own.

import (
	"fmt"
	"math"
	"sort"

	"github.com/anishathalye/porcupine"
)

type opKind uint8

const (
	opPut opKind = iota
	opGet
	opCAS
)

func (k opKind) String() string {
	switch k {
	case opPut:
		return "put"
	case opGet:
		return "get"
	case opCAS:
		return "cas"
	}
	return "?"
}

// kvInput is what a client asked for.
type kvInput struct {
	Kind   opKind `json:"kind"`
	Key    string `json:"key"`
	Value  string `json:"value,omitempty"`  // put: value written; cas: value written on success
	Expect string `json:"expect,omitempty"` // cas: value compared against
}

// kvOutput is what the client saw. Unknown means the call errored or timed out: the
// operation may or may not have taken effect, at any time after its call.
type kvOutput struct {
	Unknown   bool   `json:"unknown,omitempty"`
	Found     bool   `json:"found,omitempty"`     // get, failed cas: key existed
	Value     string `json:"value,omitempty"`     // get, failed cas: value read
	Succeeded bool   `json:"succeeded,omitempty"` // cas
}

// register is the per-key state.
type register struct {
	Found bool
	Value string
}

// infinity is the return time of an operation whose outcome is unknown.
const infinity = int64(math.MaxInt64)

func stepKV(state interface{}, input interface{}, output interface{}) (bool, interface{}) {
	s := state.(register)
	in := input.(kvInput)
	out := output.(kvOutput)
	switch in.Kind {
	case opPut:
		// Acknowledged or not, a put that is linearized sets the value.
		return true, register{Found: true, Value: in.Value}
	case opGet:
		if out.Unknown {
			return true, s
		}
		return out.Found == s.Found && (!s.Found || out.Value == s.Value), s
	case opCAS:
		matches := s.Found && s.Value == in.Expect
		if out.Unknown {
			// If it happened, it decided by the state at that point.
			if matches {
				return true, register{Found: true, Value: in.Value}
			}
			return true, s
		}
		if out.Succeeded {
			return matches, register{Found: true, Value: in.Value}
		}
		// The else branch read the key in the same transaction.
		return !matches && out.Found == s.Found && (!s.Found || out.Value == s.Value), s
	}
	return false, s
}

func partitionByKey(history []porcupine.Operation) [][]porcupine.Operation {
	byKey := map[string][]porcupine.Operation{}
	var keys []string
	for _, op := range history {
		k := op.Input.(kvInput).Key
		if _, ok := byKey[k]; !ok {
			keys = append(keys, k)
		}
		byKey[k] = append(byKey[k], op)
	}
	sort.Strings(keys)
	out := make([][]porcupine.Operation, 0, len(keys))
	for _, k := range keys {
		out = append(out, byKey[k])
	}
	return out
}

func describeOp(input interface{}, output interface{}) string {
	in := input.(kvInput)
	out := output.(kvOutput)
	res := ""
	switch {
	case out.Unknown:
		res = "?"
	case in.Kind == opPut:
		res = "ok"
	case in.Kind == opCAS && out.Succeeded:
		res = "swapped"
	case !out.Found:
		res = "absent"
	default:
		res = fmt.Sprintf("%q", out.Value)
	}
	switch in.Kind {
	case opPut:
		return fmt.Sprintf("put(%s, %q) -> %s", in.Key, in.Value, res)
	case opGet:
		return fmt.Sprintf("get(%s) -> %s", in.Key, res)
	default:
		return fmt.Sprintf("cas(%s, %q => %q) -> %s", in.Key, in.Expect, in.Value, res)
	}
}

func describeState(state interface{}) string {
	s := state.(register)
	if !s.Found {
		return "absent"
	}
	return fmt.Sprintf("%q", s.Value)
}

var kvModel = porcupine.Model{
	Partition:         partitionByKey,
	Init:              func() interface{} { return register{} },
	Step:              stepKV,
	Equal:             func(a, b interface{}) bool { return a.(register) == b.(register) },
	DescribeOperation: describeOp,
	DescribeState:     describeState,
}

// pruneHistory drops operations that cannot change the verdict: failed reads (they have no
// effect) and writes of unknown outcome whose value nobody ever observed (such a write can
// always be linearized after everything else, where it changes no observed result). Values
// are unique per write, so "observed" is exact. It keeps the checker fast after faults.
func pruneHistory(history []porcupine.Operation) []porcupine.Operation {
	observed := map[string]bool{}
	for _, op := range history {
		in, out := op.Input.(kvInput), op.Output.(kvOutput)
		if out.Unknown {
			continue
		}
		if in.Kind == opGet || (in.Kind == opCAS && !out.Succeeded) {
			if out.Found {
				observed[in.Key+"\x00"+out.Value] = true
			}
		}
		if in.Kind == opCAS && out.Succeeded {
			observed[in.Key+"\x00"+in.Expect] = true
		}
	}
	kept := history[:0:0]
	for _, op := range history {
		in, out := op.Input.(kvInput), op.Output.(kvOutput)
		if out.Unknown {
			if in.Kind == opGet {
				continue
			}
			if !observed[in.Key+"\x00"+in.Value] {
				continue
			}
		}
		kept = append(kept, op)
	}
	return kept
}

// lostWrites is the plain "no acknowledged write lost" check, independent of porcupine:
// finals maps each key to its final read. An acknowledged write w is lost when the final
// value was written by an operation that returned before w was called (so w must have come
// later), or when the key is absent at the end although w was acknowledged, or when the
// final value was never written by anyone. Returns one line per finding.
func lostWrites(history []porcupine.Operation, finals map[string]kvOutput) []string {
	type write struct {
		call, ret int64
		value     string
	}
	writesByKey := map[string][]write{}
	byValue := map[string]write{}
	for _, op := range history {
		in, out := op.Input.(kvInput), op.Output.(kvOutput)
		if in.Kind == opGet || (in.Kind == opCAS && !out.Unknown && !out.Succeeded) {
			continue
		}
		ret := op.Return
		if out.Unknown {
			ret = infinity
		}
		w := write{call: op.Call, ret: ret, value: in.Value}
		byValue[in.Key+"\x00"+in.Value] = w
		if !out.Unknown {
			writesByKey[in.Key] = append(writesByKey[in.Key], w)
		}
	}
	var findings []string
	keys := make([]string, 0, len(finals))
	for k := range finals {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		f := finals[k]
		acked := writesByKey[k]
		if !f.Found {
			if len(acked) > 0 {
				findings = append(findings, fmt.Sprintf("%s: absent at the end but %d writes were acknowledged (last %q)", k, len(acked), acked[len(acked)-1].value))
			}
			continue
		}
		last, ok := byValue[k+"\x00"+f.Value]
		if !ok {
			findings = append(findings, fmt.Sprintf("%s: final value %q was never written", k, f.Value))
			continue
		}
		for _, w := range acked {
			if w.call > last.ret {
				findings = append(findings, fmt.Sprintf("%s: acknowledged write %q (called after %q returned) lost; final value %q", k, w.value, last.value, f.Value))
			}
		}
	}
	return findings
}
