package main

// Network faults of --netns mode: partitions made with nftables in the members' namespaces
// and delays made by the lab's proxies. Every fault picks its victims with the run's seeded
// generator (given who leads at that moment), is printed, held for a seeded time around
// --partition-time, and healed before the round ends; a fault that cannot be healed stops
// the run.

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

var netFaults = map[string]bool{
	"isolate-leader": true, "isolate-follower": true, "split": true, "bridge": true,
	"one-way": true, "delay": true, "isolate-kill-leader": true,
}

// defaultNetnsFaults mixes every network fault with the kill -9 faults; the first six are
// what a short run (CI) sees.
const defaultNetnsFaults = "isolate-leader,one-way,split,kill-leader,bridge,delay,isolate-follower,isolate-kill-leader,kill-follower,one-way,kill-all,restart"

type netFault struct {
	cuts  [][2]int // (from, to): packets from member `from` to member `to` are dropped
	delay time.Duration
	slow  int // member whose links are delayed, -1 for none
	kill  int // member killed (kill -9) and restarted halfway through the partition, -1 for none
	desc  string
}

func (c *cluster) names(idx []int) string {
	var s []string
	for _, i := range idx {
		s = append(s, c.nodes[i].name)
	}
	return "{" + strings.Join(s, " ") + "}"
}

// cutBetween drops every packet between groups a and b, both ways.
func cutBetween(a, b []int) [][2]int {
	var cuts [][2]int
	for _, i := range a {
		for _, j := range b {
			cuts = append(cuts, [2]int{i, j}, [2]int{j, i})
		}
	}
	return cuts
}

func others(n int, not ...int) []int {
	var o []int
	for i := 0; i < n; i++ {
		skip := false
		for _, x := range not {
			skip = skip || x == i
		}
		if !skip {
			o = append(o, i)
		}
	}
	return o
}

// planNetFault chooses the victims of one network fault.
func planNetFault(c *cluster, fault string, leader int, rng *rand.Rand) netFault {
	n := len(c.nodes)
	f := netFault{slow: -1, kill: -1}
	followers := others(n, leader)
	pick := func(xs []int) int { return xs[rng.Intn(len(xs))] }
	role := func(i int) string {
		if i == leader {
			return c.nodes[i].name + " (leader)"
		}
		return c.nodes[i].name
	}
	switch fault {
	case "isolate-leader", "isolate-follower", "isolate-kill-leader":
		v := leader
		if fault == "isolate-follower" {
			v = pick(followers)
		}
		f.cuts = cutBetween([]int{v}, others(n, v))
		f.desc = "isolate " + role(v)
		if fault == "isolate-kill-leader" {
			f.kill = v
			f.desc += ", kill -9 it halfway, restart it still isolated"
		}
	case "split":
		// A random minority (with the leader in it half the time) against the majority.
		perm := rng.Perm(n)
		at := n - 1 // the leader goes to the majority's end, or to the minority's front
		if rng.Intn(2) == 0 {
			at = 0
		}
		for k, x := range perm {
			if x == leader {
				perm[at], perm[k] = perm[k], perm[at]
				break
			}
		}
		minority, majority := append([]int{}, perm[:(n-1)/2]...), append([]int{}, perm[(n-1)/2:]...)
		sort.Ints(minority)
		sort.Ints(majority)
		f.cuts = cutBetween(minority, majority)
		f.desc = fmt.Sprintf("split minority %s | majority %s, leader %s", c.names(minority), c.names(majority), c.nodes[leader].name)
	case "bridge":
		// One member still sees everyone; the rest are split in two halves that only meet
		// through it (a majority exists on both sides of the bridge).
		b := rng.Intn(n)
		rest := others(n, b)
		rng.Shuffle(len(rest), func(i, j int) { rest[i], rest[j] = rest[j], rest[i] })
		h := len(rest) / 2
		f.cuts = cutBetween(rest[:h], rest[h:])
		f.desc = fmt.Sprintf("bridge %s between %s and %s, leader %s", c.nodes[b].name, c.names(rest[:h]), c.names(rest[h:]), c.nodes[leader].name)
	case "one-way":
		switch rng.Intn(4) {
		case 0:
			fo := pick(followers)
			f.cuts = [][2]int{{leader, fo}}
			f.desc = fmt.Sprintf("drop %s -> %s only", role(leader), role(fo))
		case 1:
			fo := pick(followers)
			f.cuts = [][2]int{{fo, leader}}
			f.desc = fmt.Sprintf("drop %s -> %s only", role(fo), role(leader))
		case 2:
			v := rng.Intn(n)
			for _, o := range others(n, v) {
				f.cuts = append(f.cuts, [2]int{v, o})
			}
			f.desc = fmt.Sprintf("mute %s (its packets to all peers dropped, it still hears them)", role(v))
		default:
			v := rng.Intn(n)
			for _, o := range others(n, v) {
				f.cuts = append(f.cuts, [2]int{o, v})
			}
			f.desc = fmt.Sprintf("deafen %s (all peers' packets to it dropped, it still sends)", role(v))
		}
	case "delay":
		f.slow = leader
		if rng.Intn(2) == 0 {
			f.slow = pick(followers)
		}
		f.delay = time.Duration(50+rng.Intn(351)) * time.Millisecond
		f.desc = fmt.Sprintf("delay every peer byte to and from %s by %v", role(f.slow), f.delay)
	}
	return f
}

// leadersSeen asks every member whom it follows: "n1>n2 n2>n2 n3>-" (- no leader, ? no
// answer). It shows in the log that a partition moved the leadership, or did not.
func (c *cluster) leadersSeen(ctx context.Context) string {
	type res struct {
		self, leader uint64
		ok           bool
	}
	out := make([]res, len(c.nodes))
	var wg sync.WaitGroup
	for i, nd := range c.nodes {
		wg.Add(1)
		go func(i int, ep string) {
			defer guard()
			defer wg.Done()
			if r, err := status(ctx, ep, time.Second); err == nil && r.Header != nil {
				out[i] = res{r.Header.MemberId, r.Leader, true}
			}
		}(i, nd.clientURL)
	}
	wg.Wait()
	name := map[uint64]string{}
	for i, r := range out {
		if r.ok {
			name[r.self] = c.nodes[i].name
		}
	}
	var parts []string
	for i, r := range out {
		who := "?"
		if r.ok {
			who = "-"
			if r.leader != 0 {
				who = name[r.leader]
				if who == "" {
					who = fmt.Sprintf("%x", r.leader)
				}
			}
		}
		parts = append(parts, c.nodes[i].name+">"+who)
	}
	return "[" + strings.Join(parts, " ") + "]"
}

func injectNetFault(ctx context.Context, c *cluster, cfg faultConfig, fault string, rng *rand.Rand) (string, error) {
	if c.lab == nil {
		return "skipped", fmt.Errorf("%s needs --netns", fault)
	}
	v, err := c.waitHealthy(ctx, cfg.recover)
	if err != nil {
		return "skipped", fmt.Errorf("no leader to pick a victim: %w", err)
	}
	if len(c.nodes) < 2 || (fault == "bridge" && len(c.nodes) < 3) {
		return "skipped", fmt.Errorf("%s needs more members", fault)
	}
	f := planNetFault(c, fault, v.leaderIdx, rng)
	hold := cfg.partitionTime/2 + time.Duration(rng.Int63n(int64(cfg.partitionTime)+1))
	desc := fmt.Sprintf("%s for %.1fs", f.desc, hold.Seconds())
	if f.slow >= 0 {
		c.lab.setDelay(f.slow, f.delay)
		time.Sleep(hold)
		seen := c.leadersSeen(ctx)
		c.lab.setDelay(-1, 0)
		return desc + ", leaders seen before the heal " + seen, nil
	}
	if err := c.lab.setCuts(f.cuts); err != nil {
		_ = c.lab.setCuts(nil)
		return desc, err
	}
	var kerr error
	if f.kill >= 0 {
		time.Sleep(hold / 2)
		c.stop(f.kill, syscall.SIGKILL, 0)
		time.Sleep(cfg.downTime)
		kerr = c.start(f.kill)
		time.Sleep(hold / 2)
	} else {
		time.Sleep(hold)
	}
	seen := c.leadersSeen(ctx)
	return desc + ", leaders seen before the heal " + seen + ", healed", errors.Join(kerr, c.lab.setCuts(nil))
}
