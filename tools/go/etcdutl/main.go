// Command etcdutl is etcd's offline administration tool (go.etcd.io/etcd/etcdutl/v3, pinned in
// go.mod): its snapshot status and restore commands check that the etcd snapshots keel writes
// are ones etcd itself accepts. The root command is assembled here because etcdutl's own is in
// its package main.
package main

import (
	"os"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/etcdutl/v3/etcdutl"
)

func main() {
	root := &cobra.Command{Use: "etcdutl", Short: "etcd's etcdutl (snapshot, defrag, hashkv, version)"}
	root.PersistentFlags().StringVarP(&etcdutl.OutputFormat, "write-out", "w", "simple", "output format (fields, json, protobuf, simple, table)")
	root.AddCommand(etcdutl.NewSnapshotCommand(), etcdutl.NewDefragCommand(), etcdutl.NewHashKVCommand(), etcdutl.NewVersionCommand())
	if err := root.Execute(); err != nil {
		os.Exit(1)
	}
}
