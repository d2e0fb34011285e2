package main

import (
	"math/rand"
	"testing"
)

// connected says whether a majority of members can all reach each other both ways under cuts.
func majorityConnected(n int, cuts [][2]int) bool {
	cut := map[[2]int]bool{}
	for _, c := range cuts {
		cut[c] = true
	}
	for mask := 0; mask < 1<<n; mask++ {
		var members []int
		for i := 0; i < n; i++ {
			if mask&(1<<i) != 0 {
				members = append(members, i)
			}
		}
		if len(members) <= n/2 {
			continue
		}
		ok := true
		for _, a := range members {
			for _, b := range members {
				if a != b && cut[[2]int{a, b}] {
					ok = false
				}
			}
		}
		if ok {
			return true
		}
	}
	return false
}

func TestPlanNetFault(t *testing.T) {
	for _, n := range []int{3, 5} {
		c := newCluster("x", t.TempDir(), n, 1, nil, nil, "", nil)
		for seed := int64(1); seed <= 50; seed++ {
			rng := rand.New(rand.NewSource(seed))
			leader := rng.Intn(n)
			for f := range netFaults {
				p := planNetFault(c, f, leader, rng)
				for _, cut := range p.cuts {
					if cut[0] == cut[1] || cut[0] < 0 || cut[1] >= n {
						t.Fatalf("n=%d %s: bad cut %v", n, f, cut)
					}
				}
				switch f {
				case "isolate-leader", "isolate-follower", "split", "isolate-kill-leader":
					if len(p.cuts) == 0 || !majorityConnected(n, p.cuts) {
						t.Fatalf("n=%d %s (%s): want a connected majority and some cut, got %v", n, f, p.desc, p.cuts)
					}
					if (f == "isolate-leader" || f == "isolate-kill-leader") && len(p.cuts) != 2*(n-1) {
						t.Fatalf("isolate-leader: %v", p.cuts)
					}
				case "bridge":
					if len(p.cuts) == 0 {
						t.Fatalf("bridge without cuts: %s", p.desc)
					}
				case "one-way":
					for _, a := range p.cuts {
						for _, b := range p.cuts {
							if a[0] == b[1] && a[1] == b[0] {
								t.Fatalf("one-way cuts both directions: %v (%s)", p.cuts, p.desc)
							}
						}
					}
				case "delay":
					if p.slow < 0 || p.delay <= 0 || len(p.cuts) != 0 {
						t.Fatalf("delay: %+v", p)
					}
				}
			}
		}
	}
}
