// Command etcdutl is etcd's offline administration tool (snapshot restore and status, defrag,
// hashkv, migrate), assembled from the exported commands of go.etcd.io/etcd/etcdutl/v3/etcdutl
// (pinned in go.mod), because that module's own main package cannot be imported. etcd's e2e
// tests start it from their -bin-dir next to etcd and etcdctl.
package main

import (
	"os"

	"github.com/spf13/cobra"

	"go.etcd.io/etcd/etcdutl/v3/etcdutl"
)

func main() {
	root := &cobra.Command{
		Use:   "etcdutl",
		Short: "An administrative command line tool for etcd3.",
	}
	root.PersistentFlags().StringVarP(&etcdutl.OutputFormat, "write-out", "w", "simple",
		"set the output format (fields, json, protobuf, simple, table)")
	root.AddCommand(
		etcdutl.NewDefragCommand(),
		etcdutl.NewSnapshotCommand(),
		etcdutl.NewHashKVCommand(),
		etcdutl.NewVersionCommand(),
		etcdutl.NewCompletionCommand(),
		etcdutl.NewMigrateCommand(),
	)
	// etcd's tool accepts unambiguous prefixes of command names; scripts written for it may
	// rely on that.
	cobra.EnablePrefixMatching = true
	root.SetHelpTemplate(`{{.UsageString}}`)
	if err := root.Execute(); err != nil {
		os.Exit(1)
	}
}
