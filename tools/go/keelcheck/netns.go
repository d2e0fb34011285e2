package main

// The --netns lab: one network namespace per member and one hub namespace holding a bridge,
// all made and removed by keelcheck, with addresses that exist only inside them. It owns the
// namespaces, their links, their nftables tables and the delay proxies; it never changes the
// root namespace (no links, addresses, routes or rules there) and only removes namespaces
// whose name carries a keelcheck prefix of a process that no longer runs (or its own).
//
// Layout (P = "kc<pid>"):
//
//	P-hub  bridge br0 10.77.0.254/24, aliases 10.77.1.k/24 (one per member k, used by proxies)
//	P-n1   eth0 10.77.0.1/24  <- veth ->  P-hub: n1 (port of br0)
//	P-n2   eth0 10.77.0.2/24  ...
//
// keelcheck's own sockets (clients, status probes, proxies) are made inside P-hub by a thread
// that enters it with setns, so the process reaches every member without a route in the root
// namespace. Members run under `ip netns exec P-nK`, listening on 10.77.0.K:2379 (clients) and
// :2380 (peers).
//
// Every peer connection from member i to member j is sent by nftables DNAT (in P-ni) to a
// proxy in P-hub, which dials j from i's alias address; the proxy forwards bytes in order and
// can hold them back (a delay) without netem. A partition drops, in the sender's namespace,
// every packet addressed to the receiver's address or to the receiver's alias, before NAT:
// "drop i->j" loses i's requests to j and i's answers to j's requests, and nothing else.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

const (
	labSubnet     = "10.77"
	labClientPort = 2379
	labPeerPort   = 2380
	labProxyBase  = 20000 // proxy for i->j listens on hub:labProxyBase+100*i+j
)

type netLab struct {
	prefix string
	n      int
	hubFD  int // an open /run/netns/P-hub, for setns

	mu      sync.Mutex
	cuts    map[[2]int]bool // (from, to) member indexes whose packets are dropped
	proxies []*delayProxy
	made    []string // namespaces made, removed by teardown
	closed  bool
}

func (l *netLab) hub() string            { return l.prefix + "-hub" }
func (l *netLab) ns(i int) string        { return fmt.Sprintf("%s-n%d", l.prefix, i+1) }
func (l *netLab) addr(i int) string      { return fmt.Sprintf("%s.0.%d", labSubnet, i+1) }
func (l *netLab) alias(i int) string     { return fmt.Sprintf("%s.1.%d", labSubnet, i+1) }
func (l *netLab) hubAddr() string        { return labSubnet + ".0.254" }
func (l *netLab) proxyPort(i, j int) int { return labProxyBase + 100*i + j }

// checkNetnsTools says what is missing for --netns, or nil.
func checkNetnsTools() error {
	if os.Geteuid() != 0 {
		return errors.New("--netns needs root (it makes network namespaces)")
	}
	for _, t := range []string{"ip", "nft"} {
		if _, err := exec.LookPath(t); err != nil {
			return fmt.Errorf("--netns needs %s on PATH (nft: scripts/netns-deps)", t)
		}
	}
	return nil
}

func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// nft runs an nft script inside namespace ns.
func nft(ns, script string) error {
	cmd := exec.Command("ip", "netns", "exec", ns, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("nft in %s: %v: %s\nscript:\n%s", ns, err, strings.TrimSpace(string(out)), script)
	}
	return nil
}

var staleName = regexp.MustCompile(`^kc([0-9]+)-(hub|n[0-9]+)$`)

// removeStaleNamespaces deletes namespaces left by keelcheck runs that are gone (their pid
// no longer exists) or by an earlier process that had this pid. Namespaces of a keelcheck
// that still runs are left alone, and so is every name without the keelcheck pattern.
func removeStaleNamespaces() {
	out, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		return
	}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		m := staleName.FindStringSubmatch(f[0])
		if m == nil {
			continue
		}
		pid, _ := strconv.Atoi(m[1])
		if pid != os.Getpid() {
			if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err == nil {
				continue
			}
		}
		fmt.Fprintf(os.Stderr, "keelcheck: removing stale namespace %s\n", f[0])
		_ = run("ip", "netns", "del", f[0])
	}
}

// newNetLab makes the namespaces, the bridge, the veth pairs, the nftables tables and the
// proxies. On error, whatever was made is removed again.
func newNetLab(n int) (l *netLab, err error) {
	removeStaleNamespaces()
	l = &netLab{prefix: fmt.Sprintf("kc%d", os.Getpid()), n: n, hubFD: -1, cuts: map[[2]int]bool{}}
	defer func() {
		if err != nil {
			l.teardown()
		}
	}()
	mk := func(ns string) error {
		if err := run("ip", "netns", "add", ns); err != nil {
			return err
		}
		l.mu.Lock()
		l.made = append(l.made, ns)
		l.mu.Unlock()
		return run("ip", "-n", ns, "link", "set", "lo", "up")
	}
	hub := l.hub()
	if err := mk(hub); err != nil {
		return l, err
	}
	steps := [][]string{
		{"ip", "-n", hub, "link", "add", "br0", "type", "bridge"},
		{"ip", "-n", hub, "addr", "add", l.hubAddr() + "/24", "dev", "br0"},
	}
	for i := 0; i < n; i++ {
		steps = append(steps, []string{"ip", "-n", hub, "addr", "add", l.alias(i) + "/24", "dev", "br0"})
	}
	steps = append(steps, []string{"ip", "-n", hub, "link", "set", "br0", "up"})
	for i := 0; i < n; i++ {
		ns, port := l.ns(i), fmt.Sprintf("n%d", i+1)
		if err := mk(ns); err != nil {
			return l, err
		}
		steps = append(steps,
			// Both ends are made in the lab's namespaces directly: nothing passes the root one.
			[]string{"ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns},
			[]string{"ip", "-n", hub, "link", "set", port, "master", "br0", "up"},
			[]string{"ip", "-n", ns, "addr", "add", l.addr(i) + "/24", "dev", "eth0"},
			[]string{"ip", "-n", ns, "link", "set", "eth0", "up"},
			[]string{"ip", "-n", ns, "route", "add", labSubnet + ".1.0/24", "dev", "eth0"},
		)
	}
	for _, s := range steps {
		if err := run(s[0], s[1:]...); err != nil {
			return l, err
		}
	}
	for i := 0; i < n; i++ {
		if err := nft(l.ns(i), l.baseRules(i)); err != nil {
			return l, err
		}
	}
	fd, err := unix.Open("/run/netns/"+hub, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return l, fmt.Errorf("open /run/netns/%s: %w", hub, err)
	}
	l.hubFD = fd
	for i := 0; i < n; i++ {
		for j := 0; j < n; j++ {
			if i == j {
				continue
			}
			p, err := l.startProxy(i, j)
			if err != nil {
				return l, err
			}
			l.proxies = append(l.proxies, p)
		}
	}
	return l, nil
}

// baseRules is member i's nftables table: a drop chain before NAT (empty until a partition)
// and the DNAT of its peer connections to the proxies.
func (l *netLab) baseRules(i int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "table ip keelcheck {\n")
	fmt.Fprintf(&b, "  chain cut { type filter hook output priority -300; policy accept; }\n")
	fmt.Fprintf(&b, "  chain proxy { type nat hook output priority -100; policy accept;\n")
	for j := 0; j < l.n; j++ {
		if j != i {
			fmt.Fprintf(&b, "    ip daddr %s tcp dport %d dnat to %s:%d\n", l.addr(j), labPeerPort, l.hubAddr(), l.proxyPort(i, j))
		}
	}
	fmt.Fprintf(&b, "  }\n}\n")
	return b.String()
}

// setCuts replaces the partition: after it, exactly the packets from i to j for (i, j) in
// cuts are dropped. Each member's drop chain is rewritten in one nft transaction.
func (l *netLab) setCuts(cuts [][2]int) error {
	want := map[[2]int]bool{}
	for _, c := range cuts {
		want[c] = true
	}
	var errs []error
	for i := 0; i < l.n; i++ {
		script := "flush chain ip keelcheck cut\n"
		for j := 0; j < l.n; j++ {
			if want[[2]int{i, j}] {
				script += fmt.Sprintf("add rule ip keelcheck cut ip daddr { %s, %s } counter drop\n", l.addr(j), l.alias(j))
			}
		}
		if err := nft(l.ns(i), script); err != nil {
			errs = append(errs, err)
		}
	}
	l.mu.Lock()
	l.cuts = want
	l.mu.Unlock()
	return errors.Join(errs...)
}

// setDelay makes the proxies hold back every byte on the links from or to member victim
// (both directions) by d; d = 0 heals.
func (l *netLab) setDelay(victim int, d time.Duration) {
	for _, p := range l.proxies {
		if victim < 0 || p.from == victim || p.to == victim {
			p.delay.Store(int64(d))
		}
	}
}

// teardown removes the proxies and every namespace the lab made (their links, addresses and
// rules go with them). Safe to call twice and from a signal handler.
func (l *netLab) teardown() {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.closed = true
	made := l.made
	l.mu.Unlock()
	for _, p := range l.proxies {
		p.close()
	}
	if l.hubFD >= 0 {
		_ = unix.Close(l.hubFD)
	}
	for i := len(made) - 1; i >= 0; i-- {
		if err := run("ip", "netns", "del", made[i]); err != nil {
			fmt.Fprintln(os.Stderr, "keelcheck: teardown:", err)
		}
	}
}

// inHub runs f on a thread that is inside the hub namespace, so sockets f makes belong to
// it (a socket keeps its namespace for life). The thread leaves the namespace afterwards; if
// it cannot, it is discarded with its goroutine instead of being reused.
func (l *netLab) inHub(f func()) error {
	errc := make(chan error, 1)
	go func() {
		defer guard()
		runtime.LockOSThread()
		self, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			errc <- err
			return
		}
		defer unix.Close(self)
		if err := unix.Setns(l.hubFD, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns %s: %w", l.hub(), err)
			return
		}
		f()
		if err := unix.Setns(self, unix.CLONE_NEWNET); err == nil {
			runtime.UnlockOSThread()
		}
		errc <- nil
	}()
	return <-errc
}

// dial connects from the hub namespace (optionally from a given local address).
func (l *netLab) dial(ctx context.Context, local, addr string) (net.Conn, error) {
	var conn net.Conn
	var derr error
	d := net.Dialer{}
	if local != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(local)}
	}
	if err := l.inHub(func() { conn, derr = d.DialContext(ctx, "tcp", addr) }); err != nil {
		return nil, err
	}
	return conn, derr
}

// grpcDialer is the client dialer in --netns mode: every client socket lives in the hub.
func (l *netLab) grpcDialer(ctx context.Context, addr string) (net.Conn, error) {
	if i := strings.Index(addr, "://"); i >= 0 {
		addr = addr[i+3:]
	}
	return l.dial(ctx, "", addr)
}

// delayProxy forwards member from's peer connections to member to, holding bytes back by
// the current delay. Bytes keep their order; nothing is dropped, duplicated or reordered.
type delayProxy struct {
	lab      *netLab
	from, to int
	ln       net.Listener
	delay    atomic.Int64 // nanoseconds
	mu       sync.Mutex
	conns    map[net.Conn]bool
	closed   bool
}

func (l *netLab) startProxy(i, j int) (*delayProxy, error) {
	p := &delayProxy{lab: l, from: i, to: j, conns: map[net.Conn]bool{}}
	var lerr error
	if err := l.inHub(func() { p.ln, lerr = net.Listen("tcp", fmt.Sprintf("%s:%d", l.hubAddr(), l.proxyPort(i, j))) }); err != nil {
		return nil, err
	}
	if lerr != nil {
		return nil, lerr
	}
	go p.accept()
	return p, nil
}

func (p *delayProxy) track(c net.Conn, add bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if add {
		if p.closed {
			return false
		}
		p.conns[c] = true
	} else {
		delete(p.conns, c)
	}
	return true
}

func (p *delayProxy) accept() {
	defer guard()
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return
		}
		go p.serve(in)
	}
}

func (p *delayProxy) serve(in net.Conn) {
	defer guard()
	if !p.track(in, true) {
		in.Close()
		return
	}
	defer p.track(in, false)
	defer in.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	out, err := p.lab.dial(ctx, p.lab.alias(p.from), fmt.Sprintf("%s:%d", p.lab.addr(p.to), labPeerPort))
	cancel()
	if err != nil {
		return
	}
	if !p.track(out, true) {
		out.Close()
		return
	}
	defer p.track(out, false)
	defer out.Close()
	done := make(chan struct{}, 2)
	go p.pipe(in, out, done)
	go p.pipe(out, in, done)
	<-done // either side closing ends both
}

type chunk struct {
	at   time.Time
	data []byte
}

// pipe copies src to dst; each chunk is written no earlier than its arrival plus the delay
// in force when it arrived.
func (p *delayProxy) pipe(src, dst net.Conn, done chan<- struct{}) {
	defer guard()
	q := make(chan chunk, 256)
	go func() {
		defer guard()
		defer close(q)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				q <- chunk{time.Now().Add(time.Duration(p.delay.Load())), buf[:n]}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range q {
		if w := time.Until(c.at); w > 0 {
			time.Sleep(w)
		}
		if _, err := dst.Write(c.data); err != nil {
			break
		}
	}
	src.Close()
	dst.Close()
	go func() {
		for range q { // let the reader finish after dst is gone
		}
	}()
	done <- struct{}{}
}

func (p *delayProxy) close() {
	p.mu.Lock()
	p.closed = true
	conns := p.conns
	p.conns = map[net.Conn]bool{}
	p.mu.Unlock()
	_ = p.ln.Close()
	for c := range conns {
		_ = c.Close()
	}
}
