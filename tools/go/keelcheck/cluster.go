package main

// Server processes started with etcd's member flags, killed with SIGKILL or stopped with
// SIGTERM, and restarted with the same data dir: on 127.0.0.1, or with --netns each inside
// its own network namespace (started through `ip netns exec`, which execs the server in
// place, so the pid and the signals are the server's own).

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

type node struct {
	name       string
	clientURL  string
	peerURL    string
	dataDir    string
	logPath    string
	netns      string // "" on 127.0.0.1
	cmd        *exec.Cmd
	exited     chan struct{}
	startCount int
	// starts are the times of every start; memberID is the id the member's answers carry
	// (learned from Status). Together they say which incarnation gave an answer.
	starts   []time.Time
	memberID uint64
}

type cluster struct {
	bin          string
	preArgs      []string // before the member flags, e.g. "serve" for `keel serve`
	extraArgs    []string
	restartState string // "" keeps --initial-cluster-state new on restarts
	nodes        []*node
	initial      string
	lab          *netLab // nil on 127.0.0.1
	mu           sync.Mutex
}

// newCluster describes n members; with a lab each member gets its namespace and address
// (the ports are the same in every namespace), else ports P+2i and P+2i+1 on 127.0.0.1.
func newCluster(bin, workdir string, n, basePort int, pre, extra []string, restartState string, lab *netLab) *cluster {
	c := &cluster{bin: bin, preArgs: pre, extraArgs: extra, restartState: restartState, lab: lab}
	var parts []string
	for i := 0; i < n; i++ {
		nd := &node{
			name:      fmt.Sprintf("n%d", i+1),
			clientURL: fmt.Sprintf("http://127.0.0.1:%d", basePort+2*i),
			peerURL:   fmt.Sprintf("http://127.0.0.1:%d", basePort+2*i+1),
		}
		if lab != nil {
			nd.netns = lab.ns(i)
			nd.clientURL = fmt.Sprintf("http://%s:%d", lab.addr(i), labClientPort)
			nd.peerURL = fmt.Sprintf("http://%s:%d", lab.addr(i), labPeerPort)
		}
		nd.dataDir = filepath.Join(workdir, nd.name+".data")
		nd.logPath = filepath.Join(workdir, nd.name+".log")
		c.nodes = append(c.nodes, nd)
		parts = append(parts, nd.name+"="+nd.peerURL)
	}
	c.initial = strings.Join(parts, ",")
	return c
}

func (c *cluster) endpoints() []string {
	var eps []string
	for _, nd := range c.nodes {
		eps = append(eps, nd.clientURL)
	}
	return eps
}

func (c *cluster) args(nd *node) []string {
	state := "new"
	if nd.startCount > 0 && c.restartState != "" {
		state = c.restartState
	}
	a := []string{
		"--name", nd.name,
		"--data-dir", nd.dataDir,
		"--listen-client-urls", nd.clientURL,
		"--advertise-client-urls", nd.clientURL,
		"--listen-peer-urls", nd.peerURL,
		"--initial-advertise-peer-urls", nd.peerURL,
		"--initial-cluster", c.initial,
		"--initial-cluster-token", "keelcheck",
		"--initial-cluster-state", state,
	}
	a = append(append([]string{}, c.preArgs...), a...)
	return append(a, c.extraArgs...)
}

func (c *cluster) start(i int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	nd := c.nodes[i]
	if nd.cmd != nil {
		return fmt.Errorf("%s already running", nd.name)
	}
	logf, err := os.OpenFile(nd.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	args := c.args(nd)
	fmt.Fprintf(logf, "\n=== keelcheck: start %d: %s %s\n", nd.startCount+1, c.bin, strings.Join(args, " "))
	cmd := exec.Command(c.bin, args...)
	if nd.netns != "" {
		cmd = exec.Command("ip", append([]string{"netns", "exec", nd.netns, c.bin}, args...)...)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	// Own process group, and SIGKILL if keelcheck dies without cleaning up.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	// Taken before the process exists: every answer received after it is the new one's.
	nd.starts = append(nd.starts, time.Now())
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", nd.name, err)
	}
	nd.startCount++
	nd.cmd = cmd
	exited := make(chan struct{})
	nd.exited = exited
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(exited)
	}()
	return nil
}

// stop signals node i (SIGKILL, or SIGTERM with a SIGKILL after grace) and waits for exit.
func (c *cluster) stop(i int, sig syscall.Signal, grace time.Duration) {
	c.mu.Lock()
	nd := c.nodes[i]
	cmd, exited := nd.cmd, nd.exited
	nd.cmd = nil
	c.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = syscall.Kill(-cmd.Process.Pid, sig)
	select {
	case <-exited:
		return
	case <-time.After(grace):
	}
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		fmt.Fprintf(os.Stderr, "keelcheck: %s (pid %d) did not exit after SIGKILL\n", nd.name, cmd.Process.Pid)
	}
}

func (c *cluster) running(i int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	nd := c.nodes[i]
	if nd.cmd == nil {
		return false
	}
	select {
	case <-nd.exited:
		return false
	default:
		return true
	}
}

// dumpStacks appends the thread stacks of every running member to its log, so that a member
// which stops answering leaves evidence of where its threads wait: gdb's backtraces when gdb
// is installed, otherwise each thread's kernel wait channel. At most 60 s per member.
func (c *cluster) dumpStacks(reason string) {
	gdb, gdbErr := exec.LookPath("gdb")
	for i, nd := range c.nodes {
		if !c.running(i) {
			continue
		}
		c.mu.Lock()
		cmd := nd.cmd
		c.mu.Unlock()
		if cmd == nil || cmd.Process == nil {
			continue
		}
		pid := cmd.Process.Pid
		f, err := os.OpenFile(nd.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			continue
		}
		fmt.Fprintf(f, "\n=== keelcheck: thread stacks of pid %d (%s)\n", pid, reason)
		if gdbErr == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			out, _ := exec.CommandContext(ctx, gdb, "-p", strconv.Itoa(pid), "-batch", "-ex", "thread apply all bt").CombinedOutput()
			cancel()
			_, _ = f.Write(out)
		} else {
			tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", pid))
			for _, t := range tasks {
				comm, _ := os.ReadFile(filepath.Join(t, "comm"))
				wchan, _ := os.ReadFile(filepath.Join(t, "wchan"))
				fmt.Fprintf(f, "%s %s %s\n", filepath.Base(t), strings.TrimSpace(string(comm)), string(wchan))
			}
		}
		f.Close()
		fmt.Fprintf(os.Stderr, "keelcheck: %s: thread stacks appended to %s\n", nd.name, nd.logPath)
	}
}

// incarnations returns every member's start times, in ns since origin, by member id (members
// whose id was never learned are left out).
func (c *cluster) incarnations(origin time.Time) incarnations {
	c.mu.Lock()
	defer c.mu.Unlock()
	in := incarnations{}
	for _, nd := range c.nodes {
		if nd.memberID == 0 {
			continue
		}
		starts := make([]int64, 0, len(nd.starts))
		for _, t := range nd.starts {
			starts = append(starts, int64(t.Sub(origin)))
		}
		in[nd.memberID] = starts
	}
	return in
}

func (c *cluster) killAll() {
	var wg sync.WaitGroup
	for i := range c.nodes {
		wg.Add(1)
		go func(i int) { defer wg.Done(); c.stop(i, syscall.SIGKILL, 0) }(i)
	}
	wg.Wait()
}

// status asks one endpoint for Maintenance.Status.
func status(ctx context.Context, ep string, timeout time.Duration) (*clientv3.StatusResponse, error) {
	cli, err := newClient([]string{ep}, timeout)
	if err != nil {
		return nil, err
	}
	defer cli.Close()
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return cli.Status(cctx, ep)
}

type clusterView struct {
	leaderIdx int // -1 if none
	leaderID  uint64
	up        []bool
	errs      []string
}

func (c *cluster) view(ctx context.Context) clusterView {
	v := clusterView{leaderIdx: -1, up: make([]bool, len(c.nodes)), errs: make([]string, len(c.nodes))}
	type res struct {
		i    int
		resp *clientv3.StatusResponse
		err  error
	}
	ch := make(chan res, len(c.nodes))
	for i, nd := range c.nodes {
		go func(i int, ep string) {
			r, err := status(ctx, ep, time.Second)
			ch <- res{i, r, err}
		}(i, nd.clientURL)
	}
	leaders := map[uint64]int{}
	for range c.nodes {
		r := <-ch
		if r.err != nil {
			v.errs[r.i] = r.err.Error()
			continue
		}
		v.up[r.i] = true
		if r.resp.Header != nil && r.resp.Header.MemberId != 0 {
			c.mu.Lock()
			c.nodes[r.i].memberID = r.resp.Header.MemberId
			c.mu.Unlock()
		}
		if r.resp.Leader != 0 {
			leaders[r.resp.Leader]++
		}
		if r.resp.Header != nil && r.resp.Header.MemberId == r.resp.Leader && r.resp.Leader != 0 {
			v.leaderIdx, v.leaderID = r.i, r.resp.Leader
		}
	}
	// A leader that the others do not (yet) follow is not enough.
	if v.leaderIdx >= 0 && len(leaders) != 1 {
		v.leaderIdx = -1
	}
	return v
}

// waitHealthy waits until every running node answers Status and exactly one of them is the
// leader that all the others report.
func (c *cluster) waitHealthy(ctx context.Context, timeout time.Duration) (clusterView, error) {
	deadline := time.Now().Add(timeout)
	var v clusterView
	for time.Now().Before(deadline) {
		v = c.view(ctx)
		all := true
		for i := range c.nodes {
			if !v.up[i] {
				all = false
			}
		}
		if all && v.leaderIdx >= 0 {
			return v, nil
		}
		for i := range c.nodes {
			if !c.running(i) {
				return v, fmt.Errorf("%s exited (see %s)", c.nodes[i].name, c.nodes[i].logPath)
			}
		}
		select {
		case <-ctx.Done():
			return v, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	var why []string
	for i, nd := range c.nodes {
		if !v.up[i] {
			why = append(why, nd.name+": "+v.errs[i])
		}
	}
	if v.leaderIdx < 0 {
		why = append(why, "no agreed leader")
	}
	return v, fmt.Errorf("not healthy after %v: %s", timeout, strings.Join(why, "; "))
}
