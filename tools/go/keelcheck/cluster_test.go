package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// A member that stops answering gets its thread stacks appended to its log before the
// harness gives up on it; a member that has exited is skipped.
func TestDumpStacksAppendsToTheLogOfEveryRunningMember(t *testing.T) {
	dir := t.TempDir()
	c := &cluster{}
	for _, name := range []string{"live", "gone"} {
		c.nodes = append(c.nodes, &node{name: name, logPath: filepath.Join(dir, name+".log")})
	}
	live := exec.Command("sleep", "30")
	live.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := live.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = live.Process.Kill(); _ = live.Wait() }()
	c.nodes[0].cmd, c.nodes[0].exited = live, make(chan struct{})
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{})
	close(closed)
	c.nodes[1].cmd, c.nodes[1].exited = gone, closed

	c.dumpStacks("test")

	got, err := os.ReadFile(c.nodes[0].logPath)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(got), "thread stacks of pid") || len(strings.TrimSpace(string(got))) < 60 {
		t.Fatalf("no stacks in the running member's log:\n%s", got)
	}
	if _, err := os.Stat(c.nodes[1].logPath); !os.IsNotExist(err) {
		t.Fatalf("an exited member's log was written: %v", err)
	}
}
